"""Every known memory message is recognised however it is quoted: punctuation and parentheses
dropped, wrapped anywhere, numbers elided, connectives paraphrased, inside Markdown quotes and
backticks; healthy logs and vLLM's own advice are still not read as an out-of-memory failure."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomguard.doctor.diagnose import diagnose
from oomguard.logs import catalogue as cat
from oomguard.logs import parse_stream
from oomguard.logs.parsed import ParsedLog

# The canonical texts, as vllm-memory.md §2.1, §5.4 and §7.2 record them from the vLLM releases,
# and PyTorch's allocator message in its old and new forms; each with the signature it raises.
CANONICAL: list[tuple[str, str]] = [
    (
        "startup_check_failed",
        "ValueError: Free memory on device (13.13/79.19 GiB) on startup is less than desired GPU "
        "memory utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory "
        "used by other processes.",
    ),
    (
        "startup_check_failed",
        "ValueError: Free memory on device cuda:0 (38.74/121.63 GiB) on startup is less than "
        "desired GPU memory utilization (0.35, 42.57 GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes.",
    ),
    (
        "no_cache_blocks",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
    ),
    (
        "no_cache_blocks",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine (this flag also controls CPU "
        "memory reservation on the CPU backend, despite its name). See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
    ),
    (
        "kv_too_small",
        "ValueError: To serve at least one request with the models's max seq len (131072), "
        "(16.00 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(3.59 GiB).  Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
        "when initializing the engine.",
    ),
    (
        "kv_too_small",
        "ValueError: To serve at least one request with the model's max seq len (1048576), "
        "(9.8 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(4.81 GiB). Based on the available memory, the estimated maximum model length is "
        "514658. Try increasing `gpu_memory_utilization` (which also controls CPU memory on the "
        "CPU backend) or decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
    ),
    (
        "kv_too_small",
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
        "that can be stored in KV cache (7344). Try increasing `gpu_memory_utilization` or "
        "decreasing `max_model_len` when initializing the engine.",
    ),
    (
        "cuda_oom",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 1.12 GiB is free. Including non-PyTorch memory, "
        "this process has 78.06 GiB memory in use. Of the allocated memory 75.10 GiB is "
        "allocated by PyTorch, and 1.42 GiB is reserved by PyTorch but unallocated.",
    ),
    (
        "cuda_oom",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 224.00 MiB (GPU 0; "
        "23.69 GiB total capacity; 21.66 GiB already allocated; 101.06 MiB free; 22.21 GiB "
        "reserved in total by PyTorch)",
    ),
]


def _value(log: ParsedLog, name: str) -> object:
    observed = log.fields.get(name)
    return None if observed is None else observed.value


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_PARAPHRASES = [
    ("is less than", ("<", "less than", "is lower than", "below")),
    ("is larger than", (">", "larger than", "exceeds", "is greater than")),
    ("GiB", ("GB", "GiB", "G")),
]
_PUNCTUATION = "()[],.:;`'"


def mutate(text: str, rnd: random.Random) -> str:
    """One quoted variant of ``text``: each transformation applied or not at random."""
    if rnd.random() < 0.5:  # (c) numbers elided
        elision = rnd.choice(["...", "…", "N", "X"])
        text = _NUMBER.sub(lambda m: elision if rnd.random() < 0.7 else m.group(0), text)
    if rnd.random() < 0.5:  # (d) connectives paraphrased
        for canonical, forms in _PARAPHRASES:
            text = text.replace(canonical, rnd.choice(forms))
    if rnd.random() < 0.6:  # (a) punctuation and parentheses dropped or changed
        out = []
        for i, ch in enumerate(text):
            between_digits = (
                0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit()
            )
            if ch in _PUNCTUATION and not between_digits and rnd.random() < 0.5:
                out.append(rnd.choice(["", " ", "-", '"']))
            else:
                out.append(ch)
        text = "".join(out)
    quote = rnd.random() < 0.4  # (e) Markdown quote, backticks
    if rnd.random() < 0.4:
        text = "`" + text + "`"
    if rnd.random() < 0.7:  # (b) wrapped at up to three spaces
        spaces = [m.start() for m in re.finditer(" ", text)]
        for at in sorted(rnd.sample(spaces, min(len(spaces), rnd.randint(1, 3))), reverse=True):
            text = text[:at] + "\n" + text[at + 1 :]
    if quote:
        text = "\n".join("> " + line for line in text.split("\n"))
    return text


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from(CANONICAL), st.randoms(use_true_random=False))
def test_every_mutant_is_recognised(case: tuple[str, str], rnd: random.Random) -> None:
    signature, text = case
    mutant = mutate(text, rnd)
    log = parse_stream(mutant.splitlines())
    assert signature in log.signatures, mutant
    assert diagnose(log).oom_found, mutant


@pytest.mark.parametrize(("signature", "text"), CANONICAL)
def test_canonical_texts_unchanged_by_quoting(signature: str, text: str) -> None:
    """Quoted in backticks with punctuation dropped, the numbers still come out."""
    plain = parse_stream([text])
    quoted = parse_stream(["> `" + text.replace("(", " ").replace(")", " ") + "`"])
    assert signature in plain.signatures and signature in quoted.signatures
    for name, observed in plain.fields.items():
        if name.endswith(("_gib", "_len", "_tokens")) and name in quoted.fields:
            assert quoted.fields[name].value == observed.value, name


def test_condensed_and_wrapped_forms_give_their_numbers() -> None:
    log = parse_stream(
        ["> `Free memory on cuda:0 (38.74/121.63 GiB) < desired utilization (0.35, 42.57 GiB)`"]
    )
    assert "startup_check_failed" in log.signatures
    assert _value(log, "startup_free_gib") == 38.74
    assert _value(log, "startup_total_gib") == 121.63
    assert _value(log, "gpu_memory_utilization") == 0.35
    assert _value(log, "requested_gib") == 42.57

    log = parse_stream(
        [
            "ValueError: To serve at least one request with the model's max seq "
            "len (1048576), (9.8 GiB",
            "KV cache is needed, which is larger than the available",
            "KV cache memory (4.81 GiB).",
        ]
    )
    assert "kv_too_small" in log.signatures
    assert _value(log, "kv_error_max_model_len") == 1048576
    assert _value(log, "kv_needed_gib") == 9.8
    assert _value(log, "kv_available_gib") == 4.81


def test_elided_numbers_still_give_the_finding_without_figures() -> None:
    text = (
        "[rank0]: ValueError: The model's max seq len (...) is larger than the maximum number of "
        "tokens that can be stored in KV cache (...) ..."
    )
    log = parse_stream([text])
    assert "kv_too_small" in log.signatures
    assert _value(log, "kv_error_max_model_len") is None
    assert _value(log, "kv_capacity_tokens") is None
    top = diagnose(log).top
    assert top is not None and top.cause == "kv_too_small_for_max_len"


def test_every_tolerant_pattern_has_a_trigger_for_its_first_word() -> None:
    for pattern in cat.PATTERNS:
        if pattern.loose is not None:
            assert pattern.triggers, pattern.name


# --- what must still not be read as a failure -------------------------------------------------

STARTUP_ROWS = [
    json.loads(line)
    for line in Path("/work/shared/data/vllm-startup-logs.jsonl").read_text().splitlines()
    if line.strip()
]
HEALTHY_FILES = [
    Path(__file__).resolve().parents[2] / "integration" / "data" / f"{name}.log"
    for name in ("guard_pool_2048_tokens", "partial_block_len_1000", "startup_auto_kv_util")
]
ADVICE = [
    "INFO 10-24 01:26:57 [gpu_worker.py:298] Free memory on device cuda:0 (78.5/79.19 GiB) on "
    "startup. Desired GPU memory utilization is (0.9, 71.27 GiB). Actual usage is 14.99 GiB for "
    "weight, 1.2 GiB for peak activation, 0.3 GiB for non-torch memory, and 0.5 GiB for CUDAGraph "
    "memory. Replace gpu_memory_utilization config with `--kv-cache-memory=59000000000` to fit "
    "into requested memory, or `--kv-cache-memory=70000000000` to fully utilize gpu memory.",
    "INFO 05-01 12:00:00 [model_runner.py:1100] CUDA graphs can take additional 1~3 GiB memory "
    "per GPU. If you are running out of memory, consider decreasing `gpu_memory_utilization` or "
    "switching to eager mode. You can also reduce the `max_num_seqs` as needed to decrease memory "
    "usage.",
    "WARNING 05-01 12:00:00 [arg_utils.py:1000] To avoid OOM, reduce max_num_seqs or "
    "max_model_len; the KV cache memory needed depends on the available KV cache memory.",
    "INFO 05-01 12:00:00 [worker.py:280] Initial free memory: 78.50 GiB; Requested memory: 0.90 "
    "(util), 71.27 GiB",
    "INFO 05-01 12:00:00 [kv_cache_utils.py:1087] GPU KV cache size: 796,000 tokens",
    "INFO 05-01 12:00:00 [gpu_worker.py:298] Available KV cache memory: 35.68 GiB",
]


@pytest.mark.parametrize("row", range(len(STARTUP_ROWS)))
def test_startup_logs_are_not_an_oom(row: int) -> None:
    log = parse_stream(STARTUP_ROWS[row]["raw"].splitlines())
    assert not diagnose(log).oom_found


@pytest.mark.parametrize("path", HEALTHY_FILES, ids=lambda p: p.stem)
def test_healthy_recorded_logs_are_not_an_oom(path: Path) -> None:
    assert not diagnose(parse_stream(path.read_text().splitlines())).oom_found


def test_vllm_advice_is_not_an_oom() -> None:
    log = parse_stream(ADVICE)
    assert not diagnose(log).oom_found
    assert not {"startup_check_failed", "kv_too_small", "no_cache_blocks", "cuda_oom"} & set(
        log.signatures
    )


@settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
    deadline=None,
)
@given(st.randoms(use_true_random=False))
def test_healthy_log_wrapped_and_quoted_is_still_healthy(rnd: random.Random) -> None:
    """The same mutations applied to healthy lines never produce a failure."""
    lines = ADVICE + STARTUP_ROWS[rnd.randrange(len(STARTUP_ROWS))]["raw"].splitlines()[:40]
    mutated = [mutate(line, rnd) for line in lines]
    log = parse_stream("\n".join(mutated).splitlines())
    assert not {"startup_check_failed", "kv_too_small", "no_cache_blocks", "cuda_oom"} & set(
        log.signatures
    )


def test_a_message_read_in_one_record_is_not_read_again_from_joined_records() -> None:
    log = parse_stream(
        [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 384.00 MiB.",
            "GPU has 19.53 GiB total, 329.87 MiB free.",
            "PyTorch allocated: 18.40 GiB",
            "Reserved but unallocated: 402.27 MiB",
        ]
    )
    assert len(log.ooms) == 1
    assert log.ooms[0].reserved_unallocated_gib is not None
