"""Structured output: grammars that constrain sampling token by token.

A request that asks for JSON (`response_format`), a regex, a choice or a grammar brings a
`GrammarSpec` (structured.py, torch-free: the HTTP layer parses it) and gets a
`GrammarState`. Before each sampling step `apply_grammar_masks` sets the logits of every
token its grammar forbids to -inf, on that request's row only; after the step the runner
feeds the sampled token back with `GrammarState.accept`. Rows of other requests are left
alone, so an unconstrained request samples exactly what it would sample without them.

NOTE: why llguidance (1.9.x) and not xgrammar.
    - Install: llguidance is one 3 MB torch-free abi3 wheel with no dependencies.
      xgrammar 0.2.9 would add triton (a GPU compiler we never use on a CPU) and
      apache-tvm-ffi, and declares torch, so every upgrade is a resolver decision about
      the pinned CPU torch.
    - Compile cost: llguidance builds its lexer lazily (a derivative-based regex lexer
      under an Earley parser), so compiling a nested schema takes a few milliseconds and
      the rest is paid per token (0.1 to 0.3 ms per mask on our CPU). xgrammar instead
      precomputes a per-vocabulary token-mask cache when it compiles, a cost a server on
      two cores would pay on every new schema.
    - Coverage: JSON schema (nested objects, enums, anyOf, const, patterns, min/max),
      regex, Lark and GBNF grammars from one entry point; it is one of vLLM's structured
      output backends, so its answers match a vLLM replica's.

NOTE: how a compiled grammar becomes a per-request state.
    compile(spec) -> LLMatcher built once and validated (errors surface here, as an
    InvalidRequestError); cached by spec in a bounded LRU.
    GrammarState(compiled) -> a deep copy of that matcher (about 10 us), which then
    advances with the request's tokens. EOS is in a mask exactly when the grammar can end
    there; once nothing but EOS can follow, `is_done()` says so.

NOTE: JSON whitespace. Compact by default: no whitespace between tokens of the JSON, and
    `,` and `:` with nothing after them, as OpenAI writes it. Free whitespace costs tokens
    and lets a small model spend its `max_tokens` on runs of newlines and indents before
    the JSON closes (measured: benchmarks/json_tokens.py). A request that wants the
    model's own layout gives vLLM's `structured_outputs.whitespace_pattern` (a regex
    allowed at each gap; the old default here was `[ \t\n]{0,20}`); a schema can also
    override this with llguidance's "x-guidance" key.
"""

import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch
from torch import Tensor

from tierserve.errors import InvalidRequestError, TierserveError
from tierserve.structured import KINDS, GrammarSpec

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
"""llguidance's JSON options for compact JSON (see the NOTE)."""


def _json_options(spec: GrammarSpec) -> dict:
    return COMPACT_JSON if spec.whitespace is None else \
        {"whitespace_pattern": spec.whitespace}


class GrammarViolationError(TierserveError):
    """A token the request's grammar forbids was fed to its state (a masking bug)."""


@dataclass
class CompileStats:
    """Compile cache counters, for the benchmark and metrics."""

    num_compiled: int = 0
    num_cache_hits: int = 0
    compile_s: float = 0.0
    """Total seconds spent compiling (cache misses only)."""


@dataclass(frozen=True)
class CompiledGrammar:
    spec: GrammarSpec
    matcher: llguidance.LLMatcher
    """A validated matcher in its start state; states copy it and never advance it."""
    vocab_size: int
    """The tokenizer's vocabulary: logit columns at or past it are always masked."""
    eos_token_ids: tuple[int, ...]
    compile_s: float


class GrammarCompiler:
    """Turns GrammarSpecs into CompiledGrammars for one tokenizer, with an LRU cache."""

    def __init__(self, tokenizer, max_cached: int = 256,
                 eos_token_ids: list[int] | None = None):
        """`tokenizer`: a tierserve Tokenizer (its `.hf` is a fast tokenizer).
        `eos_token_ids`: the tokens that end a request (default: the tokenizer's EOS); the
        grammar allows them exactly where the output may end."""
        eos = eos_token_ids or [tokenizer.eos_token_id]
        self.eos_token_ids = tuple(eos)
        # NOTE: building the token trie takes about 0.7 s; do it once per tokenizer.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, eos_token=list(eos))
        self.vocab_size = self.ll_tokenizer.vocab_size
        self.max_cached = max_cached
        self.stats = CompileStats()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()                     # the HTTP and engine threads

    def compile(self, spec: GrammarSpec | tuple) -> CompiledGrammar:
        """Raises InvalidRequestError (param=spec.param) for a spec the library rejects."""
        if not isinstance(spec, GrammarSpec):
            kind, value = spec[0], spec[1]
            spec = GrammarSpec(kind, tuple(value) if isinstance(value, list) else value,
                               *spec[2:])
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.stats.num_cache_hits += 1
                return hit
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self.ll_tokenizer, _to_llguidance(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {spec.kind.replace('_', ' ')}: "
                                      f"{_first_lines(matcher.get_error())}", param=spec.param)
        elapsed = time.perf_counter() - start
        compiled = CompiledGrammar(spec, matcher, self.vocab_size, self.eos_token_ids, elapsed)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            self.stats.num_compiled += 1
            self.stats.compile_s += elapsed
        return compiled


def _to_llguidance(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (text); kind errors are the caller's, so they
    are raised here rather than deferred to the matcher."""
    kind, value, param = spec.kind, spec.value, spec.param
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}',
                                                             defaults=_json_options(spec))
    if not value:
        raise InvalidRequestError(f"a {kind} constraint needs a non-empty value", param=param)
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(value,
                                                                 defaults=_json_options(spec))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            if isinstance(value, str) or not all(isinstance(c, str) for c in value):
                raise InvalidRequestError("choices must be a list of strings", param=param)
            return llguidance.grammar_from("choice", list(value))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", value)      # Lark or GBNF
    except ValueError as exc:
        raise InvalidRequestError(f"invalid {kind}: {_first_lines(str(exc))}",
                                  param=param) from None
    raise InvalidRequestError(f"unknown constraint kind {kind!r}; expected one of {KINDS}",
                              param=param)


def _first_lines(message: str, limit: int = 400) -> str:
    """llguidance appends a parser-state dump to its errors; keep the human part."""
    return message.split("\n<state>")[0].strip()[:limit]


class GrammarState:
    """One request's position in its grammar. The runner keeps it across a preemption and
    recompute (the accepted tokens stay accepted), so recomputing needs nothing here."""

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self.matcher = grammar.matcher.deep_copy()
        self.num_accepted = 0

    def allowed_mask(self, vocab_size: int) -> Tensor:
        """[vocab_size] bool: the tokens allowed next (columns past the tokenizer's
        vocabulary, i.e. the model's padding, are False)."""
        bitmask = torch.zeros(1, _num_words(self.grammar.vocab_size), dtype=torch.int32)
        _fill_bitmasks([self], bitmask)
        return _unpack(bitmask, vocab_size)[0]

    def accept(self, token_id: int) -> None:
        """Advances past a sampled token; raises GrammarViolationError if it was not
        allowed (the state is then in error, and `is_done()`)."""
        if not self.matcher.consume_token(token_id):
            raise GrammarViolationError(f"token {token_id} breaks the grammar: "
                                        f"{_first_lines(self.matcher.get_error())}")
        self.num_accepted += 1

    def is_done(self) -> bool:
        """Nothing but EOS can follow (or EOS was accepted, or the state is in error):
        the request should stop."""
        return self.matcher.is_stopped()

    def can_end(self) -> bool:
        """The output so far is complete: EOS is allowed now."""
        return self.matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return _first_lines(self.matcher.get_error()) if self.matcher.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted tokens (for speculative decoding)."""
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens


def apply_grammar_masks(logits: Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Sets to -inf, in place, the logits each grammar forbids: row rows[i] of `logits`
    ([S, V], any device) follows states[i]; the other rows are untouched.

    The masks are computed on the CPU (in parallel across requests, as 32-token bitmasks),
    unpacked there, moved to the logits' device in one copy and applied as one masked_fill.
    """
    if not rows:
        return
    bitmask = torch.empty(len(rows), _num_words(states[0].grammar.vocab_size),
                          dtype=torch.int32)
    _fill_bitmasks(states, bitmask)
    forbidden = ~_unpack(bitmask, logits.shape[1]).to(logits.device, non_blocking=True)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill_(forbidden, float("-inf"))


def _num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for masks; one per process, created on first use."""
    return llguidance.LLExecutor()


def _fill_bitmasks(states: list[GrammarState], bitmask: Tensor) -> None:
    """Writes row i of `bitmask` ([R, W] int32, CPU, contiguous) from states[i]. A state
    in error would get an empty row (all -inf, NaN after softmax): it gets EOS alone, so
    the request ends."""
    words = bitmask.shape[1]
    _executor().unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)],
                                        bitmask.data_ptr(), words * 4, bitmask.shape[0])
    for i, s in enumerate(states):
        if s.matcher.is_error():
            bitmask[i] = 0
            for eos in s.grammar.eos_token_ids:
                bitmask[i, eos // 32] |= _bit(eos % 32)


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a Python int that fits int32 (bit 31 is negative)."""
    return (1 << k) - (1 << 32) * (k == 31)


def _unpack(bitmask: Tensor, num_columns: int) -> Tensor:
    """[R, W] int32 bitmask (CPU) -> [R, num_columns] bool (CPU); bit k of word w is token
    32*w + k, and columns past the bitmask (vocabulary padding) are False.

    numpy's unpackbits on the little-endian bytes is 30x faster than shifts in torch
    (0.17 ms against 5 ms for 4 rows of SmolLM2's vocabulary).
    """
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    out = np.zeros((bits.shape[0], num_columns), dtype=bool)
    n = min(num_columns, bits.shape[1])
    out[:, :n] = bits[:, :n]
    return torch.from_numpy(out)
