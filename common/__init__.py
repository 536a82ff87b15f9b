"""pdserve engine core. `from common import LLM, SamplingParams, BeamSearchParams, PoolingParams,
LoRARequest` is the offline API."""
from __future__ import annotations

__all__ = ["BeamSearchParams", "LLM", "LoRARequest", "PoolingParams", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that light users (the gateway's block hashing, the CLI's --help)
    # do not pay for importing torch.
    if name == "LLM":
        from common.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from common.engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "BeamSearchParams":
        from common.engine.beam_search import BeamSearchParams
        return BeamSearchParams
    if name == "PoolingParams":
        from common.engine.pooling_params import PoolingParams
        return PoolingParams
    if name == "LoRARequest":
        from common.engine.lora.request import LoRARequest
        return LoRARequest
    raise AttributeError(name)
