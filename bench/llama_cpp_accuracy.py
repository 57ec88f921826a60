"""Predicted vs printed llama-server buffers for tiny generated GGUFs (real llama-server, CPU).

Prints one line per buffer (model, KV, output, compute) and case, the compute buffer's error
and whether it fell in its stated range, and the conditions. Needs llama-server
(scripts/setup-llama-server.sh or $OOMGUARD_LLAMA_SERVER).

    python bench/llama_cpp_accuracy.py            # the integration tests' cases
    python bench/llama_cpp_accuracy.py --holdout  # other shapes and settings (first held-out set)
    python bench/llama_cpp_accuracy.py --holdout2 # a second held-out set
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from test_llama_cpp_real import CASES  # noqa: E402
from tiny_gguf import SHAPES, GGUFShape, write_tiny_gguf  # noqa: E402

from oomguard.tiering.compare import compare_load  # noqa: E402
from oomguard.tiering.gguf_file import read_gguf  # noqa: E402
from oomguard.tiering.memory import predict_llama_cpp  # noqa: E402
from oomguard.tiering.server import find_llama_server, running_llama_server  # noqa: E402
from oomguard.tiering.settings import LlamaCppSettings  # noqa: E402

# Shapes and settings the compute estimate was not developed on (scored once, 2026-11-25)
HOLDOUT_SHAPES = {
    "h1": GGUFShape(
        "h1-q8_0", "Q8_0", n_embd=512, n_ff=1408, n_layer=3, n_head=8, n_head_kv=4, n_vocab=3000
    ),
    "h2": GGUFShape(
        "h2-q4_k", "Q4_K", n_embd=512, n_ff=1536, n_layer=2, n_head=8, n_head_kv=8, n_vocab=2048
    ),
    "h3": GGUFShape(
        "h3-q4_0", "Q4_0", n_embd=384, n_ff=1024, n_layer=2, n_head=6, n_head_kv=2, n_vocab=5000
    ),
    "h4": GGUFShape(
        "h4-moe-q8_0",
        "Q8_0",
        n_embd=256,
        n_ff=256,
        n_layer=2,
        n_expert=8,
        n_expert_used=2,
        n_vocab=1000,
    ),
    "h5": GGUFShape(
        "h5-q6_k", "Q6_K", n_embd=256, n_ff=768, n_layer=2, n_vocab=1024, n_ctx_train=16384
    ),
}
HOLDOUT_CASES = [
    ("h1", dict(ctx_size=5000, parallel=2, ubatch_size=256)),
    ("h2", dict(ctx_size=3072, parallel=3, kv_unified=True)),
    ("h3", dict(ctx_size=2048, flash_attn=False)),
    ("h4", dict(ctx_size=4096, cache_type_k="q8_0", cache_type_v="q8_0")),
    ("h5", dict(ctx_size=16384, ubatch_size=64)),
]

# A second set, made after the first had been looked at and the range reworked (scored once)
HOLDOUT2_SHAPES = {
    "g1": GGUFShape(
        "g1-q5_0", "Q5_0", n_embd=640, n_ff=1728, n_layer=2, n_head=10, n_head_kv=2, n_vocab=4000
    ),
    "g2": GGUFShape(
        "g2-moe-q4_k", "Q4_K", n_embd=256, n_ff=512, n_layer=2, n_expert=6, n_expert_used=3
    ),
    "g3": GGUFShape(
        "g3-q8_0", "Q8_0", n_embd=768, n_ff=2048, n_layer=2, n_head=12, n_head_kv=4, n_vocab=8000
    ),
    "g4": GGUFShape("g4-bf16", "BF16", n_embd=256, n_ff=640, n_layer=2, n_vocab=1500),
}
HOLDOUT2_CASES = [
    ("g1", dict(ctx_size=6144, parallel=3, ubatch_size=384)),
    ("g2", dict(ctx_size=3000, parallel=2, kv_unified=True)),
    ("g3", dict(ctx_size=1024, flash_attn=False)),
    ("g4", dict(ctx_size=2048, mmap=False, ubatch_size=256)),
]


def main() -> int:
    binary = find_llama_server()
    args = sys.argv[1:]
    shapes, cases = (
        (HOLDOUT2_SHAPES, HOLDOUT2_CASES)
        if "--holdout2" in args
        else (HOLDOUT_SHAPES, HOLDOUT_CASES)
        if "--holdout" in args
        else (SHAPES, CASES)
    )
    exact_ok = exact_n = compute_ok = compute_n = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in cases:
            path = write_tiny_gguf(Path(tmp) / f"{name}.gguf", shapes[name])
            settings = LlamaCppSettings(**kw)  # type: ignore[arg-type]
            prediction = predict_llama_cpp(read_gguf(path), settings)
            with running_llama_server(path, settings, binary=binary) as server:
                log = server.load_log
            print(f"{name} {kw}")
            for check in compare_load(prediction, log):
                err = check.error_fraction
                extra = f"  error {err:+.1%}" if check.estimated and err is not None else ""
                print(f"  {check.line()}{extra}")
                if check.estimated:
                    compute_n += 1
                    compute_ok += check.agrees
                else:
                    exact_n += 1
                    exact_ok += check.agrees
    print(
        f"\nexact buffers equal to the print: {exact_ok}/{exact_n}; compute buffers in range: "
        f"{compute_ok}/{compute_n}"
    )
    print(
        f"conditions: llama-server {binary}, CPU only, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}"
    )
    return 0 if exact_ok == exact_n and compute_ok == compute_n else 1


if __name__ == "__main__":
    raise SystemExit(main())
