"""A llama-server backend is admitted by its slots: the backend takes the layout itself."""

from __future__ import annotations

from oomguard.guard.admission import AdmissionSettings
from oomguard.guard.backends import Backend
from oomguard.guard.config import BackendConfig
from oomguard.guard.llama_backend import LLAMA_CPP, SlotLayout


def test_admit_by_slots_sets_slot_admission_once() -> None:
    backend = Backend(BackendConfig(url="http://127.0.0.1:8080"), AdmissionSettings())
    layout = SlotLayout(slots=2, n_ctx_per_slot=512, kv_unified=False)
    assert backend.admit_by_slots(layout) is True
    assert backend.admit_by_slots(layout) is False  # the same layout again: not new
    assert backend.engine == LLAMA_CPP and backend.llama_layout == layout
    s = backend.admission.settings
    assert (s.high_watermark, s.low_watermark, s.projected_watermark) == (1.0, 1.0, 1.0)
    assert s.track_mode == "off" and s.stagger is False
    assert backend.admission.capacity_blocks == layout.slots  # one block per slot
    assert backend.admission.block_size == layout.block_tokens
