"""MetaInfer: a small, single-path LLM inference engine with vLLM's interface."""

from metainfer.llm import LLM
from metainfer.outputs import CompletionOutput, RequestOutput
from metainfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
