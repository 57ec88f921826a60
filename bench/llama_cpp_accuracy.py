"""Predicted vs printed llama-server buffers for tiny generated GGUFs (real llama-server, CPU).

Prints one line per buffer (model, KV, output, compute) and case, the compute buffer's error
and whether it fell in its stated range, and the conditions. Needs llama-server
(scripts/setup-llama-server.sh or $OOMGUARD_LLAMA_SERVER).

    python bench/llama_cpp_accuracy.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from test_llama_cpp_real import CASES  # noqa: E402
from tiny_gguf import SHAPES, write_tiny_gguf  # noqa: E402

from oomguard.tiering.compare import compare_load  # noqa: E402
from oomguard.tiering.gguf_file import read_gguf  # noqa: E402
from oomguard.tiering.memory import predict_llama_cpp  # noqa: E402
from oomguard.tiering.server import find_llama_server, running_llama_server  # noqa: E402
from oomguard.tiering.settings import LlamaCppSettings  # noqa: E402


def main() -> int:
    binary = find_llama_server()
    exact_ok = exact_n = compute_ok = compute_n = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in CASES:
            path = write_tiny_gguf(Path(tmp) / f"{name}.gguf", SHAPES[name])
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
    print(f"\nexact buffers equal to the print: {exact_ok}/{exact_n}; compute buffers in range: {compute_ok}/{compute_n}")
    print(f"conditions: llama-server {binary}, CPU only, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    return 0 if exact_ok == exact_n and compute_ok == compute_n else 1


if __name__ == "__main__":
    raise SystemExit(main())
