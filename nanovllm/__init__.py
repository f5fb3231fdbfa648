from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_output import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
