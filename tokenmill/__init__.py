"""tokenmill: an LLM inference engine where every technique is a switch you can measure."""

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
