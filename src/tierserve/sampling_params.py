"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from tierserve.structured import GrammarSpec

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (argmax); higher flattens the distribution."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 keeps all."""
    max_tokens: int | None = 16
    """Most output tokens; None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop token ids are banned until this many tokens are out."""
    stop: list[str] | str | None = None
    """Stop strings, matched on decoded text across token boundaries; not in the output."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (kept in token_ids, not in text)."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same text whatever else is in the batch."""
    ignore_eos: bool = False
    """Keep generating past EOS (for benchmarks)."""
    skip_special_tokens: bool = True
    """Drop special tokens from the decoded text."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 keeps all."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already produced."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was produced."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these token ids (-100 bans, 100 forces)."""
    grammar: "GrammarSpec | None" = None
    """Structured output: a JSON schema, JSON, a regex, a choice or a grammar the output
    must follow, enforced token by token (worker/grammar.py)."""
    defaulted: frozenset = frozenset()
    """Fields the request did not give, filled with the model's generation defaults or
    OpenAI's (a fleet gateway leaves them to the replica's own defaults)."""
    logprobs: int | None = None
    """Return each output token's log-probability and the `logprobs` most likely
    alternatives' (0: the token's own only; None: nothing). They are the model's own
    distribution, before temperature, penalties and bias (vLLM's default)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0, or -1 to disable"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must not exceed max_tokens"),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.grammar is None or not self.ignore_eos, "ignore_eos",
             "cannot be used with structured output (the grammar decides where it ends)"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be in [0, {MAX_LOGPROBS}]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (all(isinstance(t, int) and t >= 0 and -100.0 <= v <= 100.0
                 for t, v in self.logit_bias.items()), "logit_bias",
             "must map token ids to values in [-100, 100]"),
        ]
        for ok, param, rule in checks:
            if not ok:
                value = getattr(self, param)
                raise InvalidRequestError(f"{param} {rule}, got {value!r}", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Does sampling need the request's token counts?"""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)
