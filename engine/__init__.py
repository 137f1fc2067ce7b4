"""Engine core: scheduler, KV block manager, EngineCore, the engine process and the offline ``LLM``.

``from engine import LLM, SamplingParams`` is the offline API; attributes load lazily so importing one
submodule never pulls in the whole engine.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "EngineConfig", "EngineCore"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from protocol.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from worker.config import EngineConfig
        return EngineConfig
    if name == "EngineCore":
        from engine.core import EngineCore
        return EngineCore
    raise AttributeError(name)
