"""vLLM logs and tracebacks → observed numbers and signatures (one catalogue, streamed).

Used by doctor, calibration and serve alike::

    from oomguard.logs import parse_file, parse_stream
    parsed = parse_file("vllm.log")
    parsed.get("available_kv_gib"), parsed.evidence("available_kv_gib").line
"""

from oomguard.logs.parsed import Evidence, GpuProcess, Observed, OomEvent, ParsedLog, Phase
from oomguard.logs.parser import command_args, parse_file, parse_stream

__all__ = [
    "Evidence",
    "GpuProcess",
    "Observed",
    "OomEvent",
    "ParsedLog",
    "Phase",
    "command_args",
    "parse_file",
    "parse_stream",
]
