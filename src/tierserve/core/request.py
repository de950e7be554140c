"""One class per request state: counters, plus properties derived from them."""

from dataclasses import dataclass, field
from enum import IntEnum

from tierserve.tiers import Tier


class RequestStatus(IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_REFUSED = 13
    """Never started: a flex request that waited past its tier's limit."""

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REFUSED: "refused",
}


@dataclass(frozen=True)
class Owner:
    """Who a request belongs to: its tenant's fair share of a tier, and which cached
    prefixes it may reuse."""

    tenant: str = ""
    """Requests of one tenant form one flow of the tier's fair queue (core/fair.py)."""
    weight: float = 1.0
    """The tenant's share of a tier relative to the others in it."""
    cache_salt: str | None = None
    """Prefix-cache blocks are shared only between requests with the same salt (None is
    a salt too: the one of requests that name none)."""


NO_OWNER = Owner()


@dataclass(eq=False)
class Request:
    """What the scheduler knows of one request. Plain ints and lists only."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    tier: Tier = Tier.DEFAULT
    priority: int = 0
    """Lower runs first within a tier (vLLM's convention); FCFS ignores it."""
    rank: int = -1
    """Tier rank the policy orders by: the tier's (the default), or PRIORITY's once a
    default request has aged."""
    arrival_seq: int = 0
    """Tie-break among equal arrival times; set by the scheduler on admission."""
    owner: Owner = NO_OWNER
    fair_tag: float = 0.0
    """Start tag in the tier's fair queue (core/fair.py); set by the scheduler."""

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (prefix-cache hits included)."""
    block_table: list[int] = field(default_factory=list)
    """KV block ids, in order; the block manager owns the blocks."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of this request's full blocks, computed once per block."""
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first scheduling (-1: not yet)."""
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    """Tokens computed again after a preemption (wasted work)."""
    num_ever_computed: int = 0
    """High-water mark of num_computed_tokens, to count recomputation."""
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    """Draft tokens verified for it, and of them kept (speculative decoding)."""
    can_speculate: bool = True
    """Whether drafts may be verified for it (the engine says no where its sampling
    cannot take several tokens a step, e.g. logprobs)."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Draft tokens the current step verifies after the newest token (core/speculate.py)."""

    def __post_init__(self):
        if self.rank < 0:
            self.rank = int(self.tier)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
