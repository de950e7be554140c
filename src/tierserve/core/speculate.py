"""Draft tokens by prompt lookup (n-gram speculation), for the scheduler to verify.

NOTE: how
    A request's newest n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
    are looked up earlier in its own tokens (prompt and output); where they occurred
    last, the tokens that followed then are the draft. Answers that copy from their
    prompt (a summary that quotes, a code edit, an extraction) draft well; free prose
    finds no match and costs nothing.
    The step computes the newest token and the draft together (1 + k positions, each a
    decode query of the paged kernel), samples every position, and keeps the tokens up
    to and including the first one that differs from the draft
    (worker/model_runner.py). Each kept token was sampled from the model's own
    distribution at its position, with the request's own generator, one draw per kept
    token, so the output is the one the request gets without speculation (exactly, up
    to the rounding of a chunk against a single-token step).

    The index is built once per request and grown by the tokens each step adds: a dict
    per n from the n-gram to the position where it last ended, so a lookup costs O(1)
    whatever the length. Plain Python (the scheduler and its twin import it).
"""

from tierserve.config import SpeculativeConfig
from tierserve.core.request import Request


class _Index:
    __slots__ = ("ends", "upto")

    def __init__(self, sizes: range):
        self.ends = {n: {} for n in sizes}
        """n -> {n-gram: position of its last token, latest occurrence}."""
        self.upto = 0
        """Positions below this are indexed (as n-gram ends)."""


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        self._index: dict[str, _Index] = {}

    def propose(self, request: Request, limit: int) -> list[int]:
        """At most min(limit, num_speculative_tokens) draft tokens to follow the request's
        tokens so far ([] when no n-gram matches)."""
        limit = min(limit, self.config.num_speculative_tokens)
        if limit <= 0:
            return []
        tokens = request.prompt_token_ids + request.output_token_ids
        index = self._index.get(request.request_id)
        if index is None:
            index = self._index[request.request_id] = _Index(self._sizes)
        last = len(tokens) - 1
        # index every n-gram ending before the newest token (the suffix itself is not a
        # match), then look the suffix up, longest first
        for end in range(index.upto, last):
            for n, ends in index.ends.items():
                if end + 1 >= n:
                    ends[tuple(tokens[end + 1 - n:end + 1])] = end
        index.upto = max(index.upto, last)
        for n in reversed(self._sizes):
            if last + 1 < n:
                continue
            end = index.ends[n].get(tuple(tokens[last + 1 - n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + limit]
        return []

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
