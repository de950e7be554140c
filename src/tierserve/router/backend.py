"""The one interface the server's routes and the batch runner talk to.

A backend takes a request (a chat or a text prompt, sampling parameters, the tier it asks
for), streams its outputs, aborts it, says how loaded each of its units is, and takes a
new capacity setting. The in-process engine (router/local.py) and a fleet of remote
replicas (router/fleet.py) both implement it, so nothing above it asks which one it has:
what differs (rendering a chat template here, forwarding the messages there; metering
every step here, estimating from token timings there; resizing engines here, the
gateway's reserve there) is each backend's own business.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tierserve.core.outputs import RequestOutput
from tierserve.core.request import Owner
from tierserve.sampling_params import SamplingParams
from tierserve.tiers import Tier

if TYPE_CHECKING:
    from tierserve.model.tokenizer import Tokenizer
    from tierserve.schedule import HourPlan


@dataclass
class Chat:
    """A chat prompt as the client sent it (role/content dicts)."""

    messages: list[dict]


Prompt = Chat | str | list[int]
"""What a backend is asked to complete: a chat, a text, or token ids."""


class Backend(Protocol):
    max_model_len: int | None
    """Longest prompt + output in tokens (None: unknown here; the replicas check)."""
    max_num_seqs: int
    """Requests it runs at once (admission and the batch runner size by it)."""
    slo: dict
    """Per-tier latency targets (config.SLO), for SLO attainment."""
    generation_defaults: dict
    """The model's sampling defaults for fields a request leaves out (model/generation.py;
    empty: OpenAI's, or the replicas' own)."""
    errored: BaseException | None
    """Set when the backend can no longer serve (health answers 503)."""
    tokenizer: "Tokenizer | None"
    """The model's tokenizer where this process has it (/tokenize, echo)."""
    tier_map: dict[Tier, Tier]
    """Tier asked for -> the tier it is served and billed in (fixed: made once)."""

    def prepare(self, prompt: Prompt) -> Prompt:
        """Check a prompt and bring it to what `submit` takes (the in-process engine
        renders a chat with the model's template); raises InvalidRequestError."""

    async def submit(self, prompt: Prompt, params: SamplingParams, tier: Tier,
                     priority: int = 0, request_id: str | None = None,
                     owner: Owner | None = None) -> str:
        """Queue one request under `request_id` (None: one is made); its id. `owner`: its
        tenant, fair-share weight and prefix-cache salt. Raises TierserveError, queuing
        nothing."""

    def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Its outputs until it finishes; closing early aborts it."""

    def abort(self, request_id: str) -> None:
        ...

    def units(self) -> list[dict]:
        """Each engine or replica: name, kind (`engine`/`replica`), healthy, running,
        waiting, max_num_seqs, kv_usage (None where unknown). /metrics and the dashboard
        read it."""
        ...

    def kv_blocks_in_use(self) -> int | None:
        """KV blocks held by requests right now, where this process holds the KV cache
        (None: a replica's, seen only through its scraped usage)."""
        ...

    def kv_cache_config(self) -> tuple[int, int] | None:
        """(block size in tokens, blocks in all), where this process holds the KV cache:
        what `vllm:cache_config_info` says to a gateway sizing requests (None: a
        replica's)."""

    def reconfigure(self, entry: "HourPlan") -> dict:
        """Apply a capacity-schedule entry now, without dropping a request (what each
        backend can: server/capacity.py); returns what was set."""

    def restore(self) -> None:
        """Undo `reconfigure`: as the backend was started."""

    def meter(self, recorder, price_per_hour: float, sink) -> None:
        """Price every request it runs through `recorder` (and tell `sink`, a
        core.stats.StatSink, of each step and finished request)."""

    async def stop(self) -> None:
        ...
