"""tierserve: LLM serving with explicit service tiers and per-request machine cost.

`from tierserve import LLM, SamplingParams` is the offline API. The heavy parts (torch)
load on first use, so `tierserve.core` and the simulator stay torch-free.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from tierserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from tierserve.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
