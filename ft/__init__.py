"""ft: an inference engine for large hybrid mixture-of-experts models on a few GPUs.

The offline API mirrors vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``.
Names are imported lazily so that ``import ft.models.config`` stays light for tooling.
"""

from __future__ import annotations

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in __all__:
        from ft import api

        return getattr(api, name)
    raise AttributeError(f"module 'ft' has no attribute {name!r}")
