"""Failures that are not memory, read from real published logs (each file names its source):
the doctor names them with what to do, never a memory cause or a memory fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.doctor.cli import EXIT_NO_OOM, exit_code
from oomguard.doctor.diagnose import diagnose, diagnose_file
from oomguard.doctor.not_memory import KINDS
from oomguard.logs import parse_stream

DATA = Path(__file__).resolve().parent / "data" / "not_memory"
CASES = {
    "sigill_vllm_cpu_ipex.log": ("illegal_instruction", 1),
    "no_kernel_image_v1_engine.log": ("no_kernel_image", 4),
    "no_kernel_image_accelerator_error.log": ("no_kernel_image", 2),
    "cuda_driver_insufficient.log": ("cuda_driver_too_old", 2),
    "nvidia_driver_too_old.log": ("cuda_driver_too_old", 2),
    "nccl_init_system_error.log": ("nccl_init_failed", 12),
    "nccl_init_cuda_error.log": ("nccl_init_failed", 3),
}


def test_every_case_names_its_published_source() -> None:
    for name in CASES:
        first = (DATA / name).read_text().splitlines()[0]
        assert first.startswith("# source: https://github.com/"), name
    assert sorted(CASES) == sorted(p.name for p in DATA.glob("*.log"))


@pytest.mark.parametrize("name", list(CASES))
def test_published_log_is_not_memory(name: str) -> None:
    kind, line = CASES[name]
    diagnosis = diagnose_file(DATA / name)
    assert diagnosis.oom_found is False and diagnosis.findings == []
    assert exit_code(diagnosis) == EXIT_NO_OOM
    fault = diagnosis.not_memory
    assert fault is not None and fault.kind == kind
    assert fault.evidence.line == line
    payload = diagnosis.to_dict()["not_memory"]
    assert payload["kind"] == kind and payload["actions"] == list(KINDS[kind].actions)
    # what to do is never a memory setting
    for action in payload["actions"]:
        for flag in (
            "--gpu-memory-utilization",
            "--max-model-len",
            "--max-num-seqs",
            "--kv-cache-memory-bytes",
        ):
            assert flag not in action


def _diagnose(text: str):  # type: ignore[no-untyped-def]
    return diagnose(parse_stream(text.splitlines()))


def test_sigill_exit_status_and_faulthandler_lines() -> None:
    for text in (
        "Fatal Python error: Illegal instruction",
        "ERROR [core_client.py] Engine core proc EngineCore_DP0 died unexpectedly (exitcode=-4)",
        "the process exited with exit code 132",
        "kernel: traps: python3[213941] trap invalid opcode ip:7f4aa44a4e94 sp:7ffceec92e60",
    ):
        fault = _diagnose(text).not_memory
        assert fault is not None and fault.kind == "illegal_instruction", text


def test_lookalikes_are_not_faults() -> None:
    for text in (
        # a GPU kernel's fault is not the CPU's SIGILL
        "RuntimeError: CUDA error: an illegal instruction was encountered",
        # NCCL_DEBUG=INFO progress of a communicator that came up
        "node0:123:456 [0] NCCL INFO ncclCommInitRank comm 0x55d0 rank 0 nranks 2 - Init COMPLETE",
        # an NCCL error outside the communicator's set-up
        "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
    ):
        assert _diagnose(text).not_memory is None, text


def test_a_memory_failure_stays_a_memory_failure() -> None:
    text = "\n".join(
        [
            (DATA / "nccl_init_system_error.log").read_text(),
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
            "total capacity of 79.15 GiB of which 1.06 GiB is free.",
        ]
    )
    diagnosis = _diagnose(text)
    assert diagnosis.oom_found is True and diagnosis.not_memory is None


def test_real_vllm_worker_killed_by_sigill_at_its_first_request() -> None:
    """vllm-cpu 0.32.0 serving the tiny model in float32, its worker killed with SIGILL on the
    first request (tests/integration/fault_injection.py; the engine ran with
    PYTHONFAULTHANDLER=1, as oomguard serve starts it)."""
    log = Path(__file__).resolve().parents[2] / "integration" / "data" / "sigill_first_request.log"
    diagnosis = diagnose_file(log)
    assert diagnosis.oom_found is False and exit_code(diagnosis) == EXIT_NO_OOM
    fault = diagnosis.not_memory
    assert fault is not None and fault.kind == "illegal_instruction"
    assert fault.evidence.text == "Fatal Python error: Illegal instruction"
    # faulthandler's line and vLLM's "Worker proc VllmWorker-0 died unexpectedly (exit code: -4)"
    assert diagnosis.parsed.signature_counts["illegal_instruction"] == 2
