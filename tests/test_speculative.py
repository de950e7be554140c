"""Speculative decoding by prompt lookup (`--speculative-config`, core/speculate.py): the
drafts, the scheduler's verification, and the real engine's outputs, which speculation
must not change."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import check_scheduler_invariants, generate, get_engine, make_scheduler
from tierserve.config import SpeculativeConfig
from tierserve.core.request import Request
from tierserve.core.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from tierserve.core.speculate import NgramProposer
from tierserve.errors import ConfigError
from tierserve.sampling_params import SamplingParams
from tierserve.tiers import Tier


def brute_force_draft(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):      # latest earlier occurrence
            if tokens[end + 1 - n:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 5),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 8))
def test_draft_is_what_followed_the_latest_earlier_match(tokens, k, lo, extra, split):
    """Grown a few tokens at a time (as steps add them), the index proposes what a
    brute-force search over the whole sequence finds."""
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo,
                               prompt_lookup_max=lo + extra)
    proposer = NgramProposer(config)
    request = Request("r", tokens[:split], max_tokens=100)
    for i in range(split, len(tokens) + 1):
        request.output_token_ids = tokens[split:i] if i > split else []
        seq = request.prompt_token_ids + request.output_token_ids
        if not seq:
            continue
        assert proposer.propose(request, 99) == brute_force_draft(seq, k, lo, lo + extra)
    assert proposer.propose(request, 1) == brute_force_draft(tokens, 1, lo, lo + extra)


def next_token(history: list[int]) -> int:
    """A toy model: mostly repeats the token five back (so the prompt's pattern is copied
    and drafts often hold), and every seventh position says something new."""
    if len(history) % 7 == 0 or len(history) < 5:
        return 1 + sum(history[-3:]) % 50
    return history[-5]


class CopyingRunner:
    """Keeps each request's tokens by position (as a KV cache would) and samples
    `next_token` at every sampled position; verifies drafts as the model runner does."""

    def __init__(self):
        self.kv: dict[str, list[int]] = {}

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        result = RunnerOutput()
        for s in output.seqs:
            kv = self.kv.setdefault(s.request_id, [])
            del kv[s.start_pos:]
            assert len(kv) == s.start_pos, "a chunk starts where the cache ends"
            kv += s.token_ids
            if not s.sample:
                continue
            first = len(kv) - 1 - s.num_draft
            kept = []
            for i in range(s.num_draft + 1):
                kept.append(next_token(kv[:first + i + 1]))
                if i == s.num_draft or kept[-1] != kv[first + i + 1]:
                    break
            result.sampled_token_ids[s.request_id] = kept[0]
            if s.num_draft:
                result.more_token_ids[s.request_id] = kept[1:]
        return result


def run(scheduler: Scheduler, requests: list[Request]) -> tuple[dict, int]:
    for r in requests:
        scheduler.add_request(r)
    runner, steps = CopyingRunner(), 0
    while scheduler.has_unfinished():
        out = scheduler.schedule(now=float(steps))
        scheduler.update(out, runner.execute(out))
        check_scheduler_invariants(scheduler, out)
        steps += 1
        assert steps < 5000
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    return {r.request_id: list(r.output_token_ids) for r in requests}, steps


def requests_of(prompts, max_tokens, tier=Tier.DEFAULT):
    return [Request(f"r{i}", list(p), max_tokens=max_tokens, tier=tier)
            for i, p in enumerate(prompts)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 9), min_size=3, max_size=30), min_size=1, max_size=6),
       st.integers(1, 40), st.integers(1, 5), st.integers(1, 6), st.integers(18, 40))
def test_speculation_changes_no_output_and_keeps_the_invariants(prompts, max_tokens, k,
                                                                batch_limit, num_blocks):
    """Whatever the drafts, the batch limit and the KV pool (small pools preempt; the toy
    runner has no prefix cache), every
    request's output is the one it gets without speculation, every block comes back, and
    no step exceeds its budget or slots."""
    spec = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=batch_limit,
                             tiers=("default",))
    kw = dict(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=72, prefix_caching=False)
    plain, _ = run(make_scheduler(**kw), requests_of(prompts, max_tokens))
    sched = make_scheduler(speculative=spec, **kw)
    fast, _ = run(sched, requests_of(prompts, max_tokens))
    assert fast == plain
    assert sum(sched.num_accepted_tokens.values()) <= sum(sched.num_draft_tokens.values())


def speculating(spec: SpeculativeConfig, **kw) -> Scheduler:
    """A speculating scheduler without a prefix cache (the toy runner has none)."""
    return make_scheduler(prefix_caching=False, speculative=spec, **kw)


def test_a_copying_answer_takes_fewer_steps_and_only_listed_tiers_speculate():
    prompt = [3, 4, 5, 6, 7] * 4
    spec = SpeculativeConfig(num_speculative_tokens=3, tiers=("priority",))
    _, plain_steps = run(make_scheduler(prefix_caching=False),
                         requests_of([prompt], 30, Tier.PRIORITY))
    sched = speculating(spec)
    out, steps = run(sched, requests_of([prompt], 30, Tier.PRIORITY))
    assert len(out["r0"]) == 30
    assert steps < plain_steps * 0.7, (steps, plain_steps)
    assert sched.num_accepted_tokens[Tier.PRIORITY] > 0
    sched = speculating(spec)
    run(sched, requests_of([prompt], 30, Tier.DEFAULT))          # default does not speculate
    assert not sched.num_draft_tokens


def test_no_drafts_while_more_requests_run_than_the_batch_limit():
    prompt = [3, 4, 5, 6, 7] * 4
    spec = SpeculativeConfig(disable_by_batch_size=2, tiers=("default",))
    sched = speculating(spec)
    for r in requests_of([prompt] * 3, 20):
        sched.add_request(r)
    runner = CopyingRunner()
    for step in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule(now=float(step))
        if len(sched.running) > 2:
            assert not any(s.num_draft for s in out.seqs)
        sched.update(out, runner.execute(out))
    assert not sched.has_unfinished()


def test_drafts_never_pass_max_tokens():
    prompt = [3, 4, 5, 6, 7] * 4
    sched = speculating(SpeculativeConfig(num_speculative_tokens=5, tiers=("default",)))
    out, _ = run(sched, requests_of([prompt], 7))
    assert len(out["r0"]) == 7


def test_bad_speculative_configs_are_refused_by_name():
    with pytest.raises(ConfigError, match="unknown key 'num_draft'"):
        SpeculativeConfig.parse('{"method": "ngram", "num_draft": 3}')
    with pytest.raises(ConfigError, match="only 'ngram'"):
        SpeculativeConfig.parse({"method": "eagle"})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(ConfigError, match="unknown tier 'fast'"):
        SpeculativeConfig.parse({"tiers": ["fast"]})
    with pytest.raises(ConfigError, match="not JSON"):
        SpeculativeConfig.parse("{ngram}")
    assert SpeculativeConfig.parse({"tiers": "default"}).tiers == ("default",)


# ------------------------------------------------------------- the real model
COPY = ("Repeat the following text exactly:\n\nThe scheduler hands out tokens, not phases. "
        "Each request has a count of computed tokens and a count of tokens; a step gives at "
        "most a budget of tokens to at most a number of requests so that each request's "
        "computed count catches up with its tokens.")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "tiers": ["default"]}


def chat(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=60, temperature=0),
    SamplingParams(max_tokens=60, temperature=0.8, seed=11),
    SamplingParams(max_tokens=60, temperature=0, stop=["budget"]),
    SamplingParams(max_tokens=40, temperature=0, logprobs=2),
    SamplingParams(max_tokens=60, temperature=0.7, top_p=0.9, seed=5, frequency_penalty=0.3),
], ids=["greedy", "seeded", "stop", "logprobs", "penalties"])
def test_the_real_model_answers_the_same_with_and_without_drafts(params):
    plain = get_engine()
    fast = get_engine(speculative_config=SPEC)
    prompt = chat(plain, COPY)
    a = generate(plain, [prompt], params)[0].outputs[0]
    drafts = sum(fast.scheduler.num_draft_tokens.values())
    b = generate(fast, [prompt], params)[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
    if params.logprobs is None:
        assert sum(fast.scheduler.num_draft_tokens.values()) > drafts
    else:                                    # logprobs are per token: no drafts for them
        assert sum(fast.scheduler.num_draft_tokens.values()) == drafts
        assert len(b.logprobs) == len(b.token_ids)
    if params.stop:
        assert "budget" not in b.text and a.finish_reason == "stop"


def test_the_real_model_keeps_drafts_and_bills_each_token_once():
    fast = get_engine(speculative_config=SPEC)
    before = sum(fast.scheduler.num_accepted_tokens.values())
    out = generate(fast, [chat(fast, COPY)], SamplingParams(max_tokens=60, temperature=0))[0]
    assert sum(fast.scheduler.num_accepted_tokens.values()) - before >= 30
    stats = out.metrics
    assert stats.num_output_tokens == len(out.outputs[0].token_ids) == len(stats.token_times)


def test_served_over_http_with_the_counters_on_metrics():
    """`/v1/chat/completions` on an engine that speculates: the copied answer, its usage,
    and vLLM's and tierserve's draft counters on `/metrics`."""
    import httpx

    from test_server import LiveServer
    from tierserve.server.settings import ServerSettings

    srv = LiveServer(ServerSettings(), speculative_config=SPEC)
    try:
        r = srv.client().chat.completions.create(
            model="smol", messages=[{"role": "user", "content": COPY}], max_tokens=60,
            temperature=0)
        assert r.choices[0].message.content.startswith("The scheduler hands out tokens")
        assert r.usage.completion_tokens <= 60
        text = httpx.get(srv.url + "/metrics").text
        kept = [line for line in text.splitlines()
                if line.startswith("tierserve_spec_accepted_tokens_total{") and 'tier="default"' in line]
        assert kept and float(kept[0].split()[-1]) > 0
        assert "vllm:spec_decode_num_accepted_tokens_total{" in text
    finally:
        srv.stop()
