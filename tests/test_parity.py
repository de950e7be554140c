"""Logit parity with Hugging Face transformers on the same GGUF, in float32.

Both sides dequantize the same Q4_1/Q8_0 blocks with `gguf`, and transformers undoes
llama.cpp's Q/K permutation with its own code, so this checks our loader, RoPE layout,
GQA and the paged-KV attention path against an independent implementation.
Bound: max |logit difference| < 1e-3 over all vocabulary entries (logits here span
about -31..+38; measured 7.5e-5 on the prefill; differences come from summation order).
"""

import contextlib
import os

import pytest
import torch

from tierserve.core.request import Request
from tierserve.core.scheduler import ScheduledSeq

BOUND = 1e-3


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    folder, name = os.path.split(default_model_path)
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()


@contextlib.contextmanager
def reserved_blocks(engine, num_tokens):
    """Blocks taken from the engine's pool for a hand-driven forward pass, then returned,
    so no cached prefix block of another test is overwritten."""
    holder = Request(request_id="parity-blocks", prompt_token_ids=[0] * num_tokens,
                     max_tokens=1)
    assert engine.block_manager.allocate_slots(holder, num_tokens)
    try:
        yield list(holder.block_table)
    finally:
        engine.block_manager.free(holder)


def our_logits(runner, request_id, tokens, start, block_table):
    """Logits of every token of a chunk, through the runner's paged-KV forward pass."""
    seq = ScheduledSeq(request_id, tokens, start, block_table, sample=True,
                       is_decode=len(tokens) == 1, num_output_tokens=0)
    input_ids, positions, attn, _ = runner._prepare([seq])
    with torch.inference_mode():
        hidden = runner.model(input_ids, positions, attn, runner.kv_caches)
        return runner.model.compute_logits(hidden)


def test_prefill_and_decode_logits_match_transformers(hf_model):
    from conftest import get_engine
    engine = get_engine()
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user",
                                       "content": "Name three colours of the rainbow."}])
    with reserved_blocks(engine, len(prompt) + 8) as table:
        check_prefill_and_decodes(engine, hf_model, prompt, table)


def check_prefill_and_decodes(engine, hf_model, prompt, table):
    ours = our_logits(engine.runner, "parity", prompt, 0, table)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max().item() < BOUND
    tokens = list(prompt)
    for _ in range(6):                                    # decode steps over the paged cache
        tokens.append(int(ref[-1].argmax()))
        ours = our_logits(engine.runner, "parity", tokens[-1:], len(tokens) - 1, table)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([tokens])).logits[0]
        diff = (ours[0] - ref[-1]).abs().max().item()
        assert diff < BOUND, f"decode step {len(tokens) - len(prompt)}: {diff}"


def test_chunked_prefill_logits_match_transformers(hf_model):
    from conftest import get_engine
    engine = get_engine()
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    with reserved_blocks(engine, len(prompt)) as table:
        first = our_logits(engine.runner, "chunks", prompt[:13], 0, table)
        rest = our_logits(engine.runner, "chunks", prompt[13:], 13, table)
    assert (torch.cat([first, rest]) - ref).abs().max().item() < BOUND


def test_returned_logprobs_are_the_models_own_distribution(hf_model):
    """logprobs of sampled tokens (and the top alternatives) against transformers' forward
    pass over the same tokens: the model's distribution, before temperature or penalties,
    whatever else shares the batch."""
    from conftest import generate, get_engine
    from tierserve.sampling_params import SamplingParams
    engine = get_engine()
    prompt = engine.tokenizer.encode("The capital of France is")
    asked = SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=5,
                           frequency_penalty=1.0, ignore_eos=True)
    out, _ = generate(engine, [prompt, prompt[:3]],
                      [asked, SamplingParams(temperature=0, max_tokens=6)])
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt + c.token_ids])).logits[0].log_softmax(-1)
    for i, (token, (lp, top)) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp - row[token].item()) < 1e-3
        assert [t for t, _ in top] == row.topk(5).indices.tolist()
        assert all(abs(x - row[t].item()) < 1e-3 for t, x in top)
        assert lp <= top[0][1] + 1e-6 and sum(torch.tensor([x for _, x in top]).exp()) <= 1
