"""Batched sampling with per-request seeds.

NOTE: why inverse-CDF sampling. Each request owns a torch.Generator (seeded by its own
seed, or by the engine's seed stream). A step draws exactly one uniform number per sampled
request from that request's generator and picks the token where the cumulative
probability crosses it. What a request draws therefore depends only on its own seed and
its own logits, never on which other requests share the batch, while the heavy work
(temperature, top-k, top-p, min-p, softmax, cumsum) stays batched.

NOTE: what changes the logits, in order (vLLM's order and definitions)
    1. logit_bias, added to the named tokens;
    2. penalties on the tokens the request has produced (and, for the repetition penalty,
       its prompt): frequency (minus the count times the penalty), presence (minus the
       penalty once), repetition (positive logits divided by it, negative ones multiplied);
    3. the grammar's mask, for structured output (worker/grammar.py);
    4. tokens banned before min_tokens; then greedy takes the argmax, and sampling applies
       temperature, top-k, softmax, top-p and min-p (tokens below min_p times the most
       likely one's probability are dropped).
    Only the rows of requests that asked for something are touched.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from tierserve.model import kernels
from tierserve.sampling_params import SamplingParams
from tierserve.worker.grammar import GrammarState, GrammarViolationError, apply_grammar_masks


@dataclass
class SamplingState:
    params: SamplingParams
    generator: torch.Generator
    banned_before_min: list[int] = field(default_factory=list)
    """EOS and stop token ids, masked while fewer than min_tokens are out."""
    counts: Tensor | None = None
    """How often each token was produced ([V] float32), for the penalties."""
    prompt_seen: Tensor | None = None
    """Tokens of the prompt ([V] bool), for the repetition penalty."""
    bias: tuple[Tensor, Tensor] | None = None
    """logit_bias as (token ids, values)."""
    grammar: GrammarState | None = None
    """Structured output: what the grammar allows next (worker/grammar.py)."""
    last_logprob: tuple[float, list[tuple[int, float]]] | None = None
    """With params.logprobs: the last sampled token's logprob and the top alternatives."""

    @classmethod
    def create(cls, params: SamplingParams, generator: torch.Generator, banned: list[int],
               vocab_size: int, prompt_token_ids: list[int]) -> "SamplingState":
        state = cls(params, generator, banned)
        if params.penalized:
            state.counts = torch.zeros(vocab_size)
        if params.repetition_penalty != 1.0:
            state.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool)
            state.prompt_seen[torch.tensor(prompt_token_ids, dtype=torch.long)] = True
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            state.bias = ids, torch.tensor(list(params.logit_bias.values()))
        return state

    def produced(self, token: int) -> None:
        if self.counts is not None:
            self.counts[token] += 1


def sample(logits: Tensor, states: list[SamplingState], num_outputs: list[int]) -> list[int]:
    """logits: [S, V] float32, one row per sampled request. Returns S token ids."""
    want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    raw = logits[want].log_softmax(dim=-1) if want else None  # before anything changes them
    _adjust(logits, states)
    constrained = [i for i, s in enumerate(states) if s.grammar is not None]
    apply_grammar_masks(logits, constrained, [states[i].grammar for i in constrained])
    for i, (state, n) in enumerate(zip(states, num_outputs)):
        # a grammar decides where its output ends: banning EOS could leave nothing allowed
        if n < state.params.min_tokens and state.banned_before_min and state.grammar is None:
            logits[i, state.banned_before_min] = float("-inf")
    tokens = greedy_tokens(logits)
    rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if rows:
        chosen = _sample_random(logits[rows], [states[i] for i in rows])
        tokens[rows] = chosen
    out = tokens.tolist()
    for state, token in zip(states, out):
        state.produced(token)
        if state.grammar is not None and not state.grammar.is_done():
            try:
                state.grammar.accept(token)
            except GrammarViolationError:  # cannot happen under the mask; if it did, the
                pass                       # state is in error and allows only EOS: it ends
    for j, i in enumerate(want):
        k = states[i].params.logprobs
        top = raw[j].topk(k) if k else None
        states[i].last_logprob = (float(raw[j, out[i]]), list(zip(
            top.indices.tolist(), top.values.tolist())) if top is not None else [])
    return out


def greedy_tokens(logits: Tensor) -> Tensor:
    """Each row's argmax (the first largest, as torch.max gives it): the CPU kernel's where
    it is built (6.5x torch's max at 64 rows of 49,152 logits, 7x at one row, 2-core EPYC
    Zen 5), else torch's max (2.5x faster than argmax)."""
    kernel = kernels.load() if logits.device.type == "cpu" else None
    if kernel is not None and logits.dtype == torch.float32 and logits.is_contiguous() \
            and logits.dim() == 2:
        return kernel.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _adjust(logits: Tensor, states: list[SamplingState]) -> None:
    """logit_bias, then the penalties, on the rows that asked for them (in place)."""
    for i, s in enumerate(states):
        if s.bias is not None:
            ids, values = s.bias
            logits[i, ids] += values
    rows = [i for i, s in enumerate(states) if s.counts is not None]
    if not rows:
        return
    counts = torch.stack([states[i].counts for i in rows])            # [R, V]
    params = [states[i].params for i in rows]
    sub = logits[rows]
    freq = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
    sub -= freq * counts + pres * (counts > 0)
    reps = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in reps):
        seen = counts > 0
        for j, i in enumerate(rows):
            if states[i].prompt_seen is not None:
                seen[j] |= states[i].prompt_seen
        rep = torch.tensor(reps).unsqueeze(1).expand_as(sub)
        rep = torch.where(seen, rep, torch.ones_like(rep))
        sub = torch.where(sub > 0, sub / rep, sub * rep)
    logits[rows] = sub


def _sample_random(logits: Tensor, states: list[SamplingState]) -> Tensor:
    """A token per row, drawn with each request's generator: the CPU kernel's draw
    (model/cpu_sample.py) for rows at a temperature and top_p, torch's for rows with
    top_k or min_p, or where the kernel is not built. Each row takes one uniform from its
    generator either way, so a seeded request draws the same numbers on both paths."""
    # 1 - U is in (0, 1], so the pick always lands on a token with non-zero probability.
    u = torch.tensor([1.0 - torch.rand(1, generator=s.generator).item() for s in states])
    kernel = kernels.load() if logits.device.type == "cpu" else None
    if kernel is None or logits.dtype != torch.float32:
        return _sample_torch(logits, [s.params for s in states], u.to(logits.device))
    plain = [i for i, s in enumerate(states) if not (s.params.top_k or s.params.min_p)]
    out = torch.empty(len(states), dtype=torch.long)
    if plain:
        params = [states[i].params for i in plain]
        every = len(plain) == len(states) and logits.is_contiguous()
        out[plain] = kernel.sample_rows(
            logits if every else logits[plain], torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_p for p in params]), u if every else u[plain].contiguous())
    if len(plain) < len(states):
        rest = [i for i in range(len(states)) if i not in set(plain)]
        out[rest] = _sample_torch(logits[rest], [states[i].params for i in rest], u[rest])
    return out


def _sample_torch(logits: Tensor, params: list[SamplingParams], u: Tensor) -> Tensor:
    """The torch path: temperature, top_k, softmax, top_p, min_p, then the first token
    whose cumulative probability reaches u times the total, for u in (0, 1]."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps.unsqueeze(1)
    top_ks = [p.top_k for p in params]
    if any(top_ks):
        logits = _apply_top_k(logits, top_ks)
    probs = logits.softmax(dim=-1)
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        probs = _apply_top_p(probs, top_ps)
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        floor = torch.tensor(min_ps).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)                 # keeps the top one
    cdf = probs.cumsum(dim=-1)                                        # [S, V]
    target = (u * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target).squeeze(1)
    return picked.clamp_(max=logits.shape[1] - 1)


def _apply_top_k(logits: Tensor, top_ks: list[int]) -> Tensor:
    vocab = logits.shape[1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    values = logits.topk(int(ks.max()), dim=-1).values                # [S, kmax] descending
    threshold = values.gather(1, (ks - 1).unsqueeze(1))               # k-th largest per row
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_p(probs: Tensor, top_ps: list[float]) -> Tensor:
    """Keep, per row, the most probable tokens until their mass reaches top_p (the top
    one always). A token is kept when the mass before it is below p, so once the k most
    probable hold p none past them is: the nucleus is found among `topk(k)`, k growing
    from TOP_P_FIRST_K until it holds p, instead of sorting the whole vocabulary. Sorting
    49,152 probabilities took 5 ms per row on a 2-core Zen 4 (46 ms for 16 rows, more
    than the model's step), and SmolLM2's defaults (temperature 0.2, top_p 0.9) put
    every default request on this path (benchmarks/sampler.py)."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]  # top_p 1 keeps every token
    sub = probs[rows]
    p = torch.tensor([top_ps[i] for i in rows], device=probs.device).unsqueeze(1)
    vocab, k = sub.shape[1], min(TOP_P_FIRST_K, sub.shape[1])
    while True:
        top, order = sub.topk(k, dim=-1)                              # descending
        if k == vocab or bool((top.sum(dim=-1, keepdim=True) >= p).all()):
            break
        k = min(k * 8, vocab)
    mass_before = top.cumsum(dim=-1) - top
    top = top.masked_fill(mass_before >= p, 0.0)                      # always keeps the top one
    probs = probs.clone()
    probs[rows] = torch.zeros_like(sub).scatter_(1, order, top)
    return probs


TOP_P_FIRST_K = 128
"""Candidates looked at first for top_p: at temperature 0.2 the top 128 of SmolLM2's
49,152 tokens hold 0.9 of the mass on nearly every step; a row that needs more grows k
eightfold (1,024, 8,192, then all)."""
