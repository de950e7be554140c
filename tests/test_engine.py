"""The engine on the real default model (float32, CPU): invariance, caching, sampling."""

import asyncio

import pytest

from conftest import generate, get_engine
from tierserve.sampling_params import SamplingParams
from tierserve.tiers import Tier

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "volcanoes", "tea", "bicycles",
          "glaciers", "violins", "bees", "lighthouses", "deserts", "comets", "maps", "salt"]


def chat_prompts(engine, n=16):
    return [engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Tell me one fact about {t}."}]) for t in TOPICS[:n]]


def assert_all_blocks_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def alone():
    """Greedy outputs of each prompt run by itself: the reference for invariance tests."""
    engine = get_engine()
    prompts = chat_prompts(engine)
    return prompts, [generate(engine, [p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_chat_answer_is_sensible():
    engine = get_engine()
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    out = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_batched_outputs_equal_outputs_alone(alone):
    prompts, expected = alone
    engine = get_engine()
    outs = generate(engine, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(engine)


def test_small_chunks_give_the_same_outputs(alone):
    prompts, expected = alone
    engine = get_engine(max_num_batched_tokens=24)   # every prompt is split into chunks
    outs = generate(engine, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(engine)


def test_unchunked_prefill_gives_the_same_outputs(alone):
    prompts, expected = alone
    engine = get_engine(enable_chunked_prefill=False, max_num_batched_tokens=2048,
                        max_model_len=2048)
    outs = generate(engine, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_tiny_kv_pool_forces_preemption_and_keeps_outputs(alone):
    prompts, expected = alone
    engine = get_engine(num_kv_blocks=24, block_size=8)  # ~4 requests' worth of KV
    before = engine.scheduler.num_preemptions
    outs = generate(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > before
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(engine)


def test_prefix_cache_computes_fewer_tokens_and_keeps_output():
    engine = get_engine()
    system = "You are a careful assistant. " * 12
    prompts = [engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("What is 2 + 2?", "Name a fruit.")]
    engine.block_manager.reset_prefix_cache()
    cold = generate(engine, [prompts[1]], GREEDY)[0]
    engine.block_manager.reset_prefix_cache()
    generate(engine, [prompts[0]], GREEDY)
    warm = generate(engine, [prompts[1]], GREEDY)[0]
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    bs = engine.block_manager.block_size
    assert common >= 64
    assert cold.metrics.num_cached_tokens == 0
    assert warm.metrics.num_cached_tokens == common // bs * bs   # every full shared block
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_stop_string_across_tokens_is_cut_and_not_emitted():
    engine = get_engine()
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    full = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=30))[0]
    text = full.outputs[0].text
    cut = text.index("France") + 3                      # "Fra": ends inside a token
    stop = text[cut - 5:cut]
    out = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=30,
                                                    stop=[stop]))[0]
    assert out.outputs[0].text == text[:text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    # Streamed deltas never contain the stop string or anything after it.
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    streamed = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed += o.delta_text
    assert streamed == out.outputs[0].text


def test_max_tokens_and_min_tokens():
    engine = get_engine()
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    short = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(short.outputs[0].token_ids) == 3 and short.outputs[0].finish_reason == "length"
    free = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=200))[0]
    natural = len(free.outputs[0].token_ids)
    assert free.outputs[0].finish_reason == "stop" and natural < 200
    longer = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=200,
                                                       min_tokens=natural + 5))[0]
    assert len(longer.outputs[0].token_ids) >= natural + 5
    eos = engine.eos_token_id
    assert eos not in longer.outputs[0].token_ids[:natural + 4]


def test_same_seed_same_text_whatever_the_batch():
    engine = get_engine()
    prompts = chat_prompts(engine, 6)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=20)
    alone = generate(engine, [prompts[0]], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=20)
    batch = generate(engine, prompts, [p] + [others] * 5)
    assert batch[0].outputs[0].token_ids == alone
    other_seed = generate(engine, [prompts[0]], SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=8, max_tokens=20))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_top_k_one_is_greedy():
    engine = get_engine()
    prompt = chat_prompts(engine, 1)[0]
    greedy = generate(engine, [prompt], GREEDY)[0].outputs[0].token_ids
    k1 = generate(engine, [prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=24,
                                                   ignore_eos=True, seed=3))[0]
    assert k1.outputs[0].token_ids == greedy


@pytest.mark.parametrize("text", ["天气很好，我们去公园散步吧。", "Party time 🎉🎈 with 🐍!"])
def test_streamed_text_is_valid_utf8_and_complete(text):
    engine = get_engine()
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat exactly: {text}"}])
    engine.add_request("u", prompt, SamplingParams(temperature=0, max_tokens=40))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.delta_text)
            final = o
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == final.outputs[0].text
    # The detokenizer's text equals a one-shot decode of all tokens.
    assert final.outputs[0].text == engine.tokenizer.decode(final.outputs[0].token_ids)


def test_multibyte_tokens_are_held_until_complete():
    """Feed the detokenizer an emoji's byte-level tokens one by one."""
    from tierserve.engine.detokenizer import IncrementalDetokenizer
    tok = get_engine().tokenizer
    ids = tok.encode("ok 🐍🎉 done", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], [])
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces.append(detok.take_delta(False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "ok 🐍🎉 done"
    assert any(p == "" for p in pieces)                  # some token held a partial emoji


def test_abort_frees_blocks_at_once():
    engine = get_engine()
    engine.add_request("a", chat_prompts(engine, 1)[0], GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert_all_blocks_free(engine)


def test_bad_requests_raise_and_queue_nothing():
    from tierserve.errors import InvalidRequestError
    engine = get_engine()
    with pytest.raises(InvalidRequestError):
        engine.add_request(None, "", GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request(None, [1, 2, 10**9], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request(None, "hi", SamplingParams(max_tokens=10**6))
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_p=0)
    assert not engine.has_unfinished_requests()


def test_async_engine_streams_and_aborts():
    from tierserve.engine.async_engine import AsyncEngine
    engine = get_engine()
    prompts = chat_prompts(engine, 3)

    async def main():
        aengine = AsyncEngine(engine)

        async def full(p):
            text = ""
            async for out in aengine.generate(p, GREEDY):
                text += out.delta_text
            return text, out

        async def leave_early(p):
            n = 0
            async for _ in aengine.generate(p, SamplingParams(max_tokens=200, ignore_eos=True)):
                n += 1
                if n == 3:
                    break                                  # the client goes away
            return n

        results = await asyncio.gather(full(prompts[0]), full(prompts[1]),
                                       leave_early(prompts[2]))
        await aengine.stop()
        return results

    (t0, o0), (t1, o1), n = asyncio.run(main())
    assert t0 == o0.outputs[0].text and o0.outputs[0].finish_reason == "length"
    assert t1 == o1.outputs[0].text and n == 3
    assert_all_blocks_free(engine)


def test_priority_outputs_are_identical_under_background_load(alone):
    """Preemption, the step-time cap and tier order change timing, never text."""
    prompts, expected = alone
    engine = get_engine(max_num_seqs=4, num_kv_blocks=40, priority_step_time_s=0.001)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    quiet = generate(engine, prompts[:1], seeded)[0].outputs[0].token_ids
    background = [engine.add_request(None, p, SamplingParams(max_tokens=40, ignore_eos=True),
                                     tier=tier)
                  for p, tier in zip(prompts[4:12], ["batch", "flex", "default"] * 3)]
    for _ in range(3):
        engine.step()  # the background is running when priority arrives
    ids = [engine.add_request(None, p, GREEDY, tier="priority") for p in prompts[:3]]
    ids.append(engine.add_request(None, prompts[0], seeded, tier="priority"))
    done = {}
    preempted = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    preempted = engine.scheduler.preemptions_by_tier
    assert [done[i].outputs[0].token_ids for i in ids[:3]] == expected[:3]
    assert done[ids[3]].outputs[0].token_ids == quiet
    assert all(done[i].metrics.tier == Tier.PRIORITY for i in ids)
    assert all(done[i].outputs[0].finish_reason == "length" for i in background)
    assert preempted[Tier.PRIORITY] == 0 and sum(preempted.values()) > 0
    assert engine.scheduler.recomputed_tokens_by_tier[Tier.PRIORITY] == 0
    assert_all_blocks_free(engine)


def test_overdue_flex_request_is_refused_and_others_are_not():
    engine = get_engine()
    late = engine.add_request(None, [5, 6, 7], GREEDY, tier="flex",
                              arrival_time=engine.clock.now() - 1000)
    fresh = engine.add_request(None, [5, 6, 7], GREEDY, tier="flex")
    outs = {o.request_id: o for o in engine.step()}
    assert outs[late].finished and outs[late].outputs[0].finish_reason == "refused"
    assert outs[late].outputs[0].token_ids == []
    assert fresh in outs and not outs[fresh].finished
    engine.abort_request(fresh)
    assert_all_blocks_free(engine)


def test_unknown_tier_is_a_clear_error():
    from tierserve.errors import InvalidRequestError
    engine = get_engine()
    with pytest.raises(InvalidRequestError, match="unknown tier 'gold'"):
        engine.add_request(None, [5, 6, 7], GREEDY, tier="gold")
    assert not engine.has_unfinished_requests()
