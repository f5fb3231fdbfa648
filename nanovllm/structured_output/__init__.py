"""Structured outputs: constraints (JSON schema, regex, choice, grammar, JSON object, structural tag)
compiled by xgrammar and applied as token bitmasks in the sampler. `params.py` is what a request
says, `compiler.py` compiles it against the vocabulary (cached), `manager.py` is the engine's
interface (per-sequence matchers, mask filling). xgrammar is imported only once a constrained
request arrives."""
from nanovllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
