"""pd-serve: prefill/decode disaggregated LLM serving.

The public names load on first use, so importing a submodule (`pd_serve.model.gptq` from
kernels/w4a16.py, say) does not import the whole engine first.
"""

import importlib

__all__ = ["Engine", "AsyncEngine", "RequestOutput", "SamplingParams"]
_MODULES = {"Engine": "pd_serve.engine.engine", "AsyncEngine": "pd_serve.engine.async_engine",
            "RequestOutput": "pd_serve.engine.output",
            "SamplingParams": "pd_serve.engine.sampling_params"}


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'pd_serve' has no attribute {name!r}")
