"""pd-serve: prefill/decode disaggregated LLM serving."""

from pd_serve.engine.engine import Engine
from pd_serve.engine.async_engine import AsyncEngine
from pd_serve.engine.output import RequestOutput
from pd_serve.engine.sampling_params import SamplingParams

__all__ = ["Engine", "AsyncEngine", "RequestOutput", "SamplingParams"]
