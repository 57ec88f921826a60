"""oomguard: keep vLLM deployments out of out-of-memory failures."""

__version__ = "0.1.0"
