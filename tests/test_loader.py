"""Model loading: Hugging Face folders, GGUF files (quant types, Q/K permutation), dummy
weights, and a clear error for each way a checkpoint can be wrong."""

import json

import numpy as np
import pytest
import torch

from conftest import torch_threads
from tierserve.config import ModelConfig
from tierserve.core.scheduler import ScheduledSeq
from tierserve.errors import ModelLoadError, UnsupportedModelError
from tierserve.model.loader import load_model
from tierserve.worker.model_runner import ModelRunner

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A random tiny Llama saved as a Hugging Face folder, and the transformers model."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY)
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def logits_of(loaded, tokens):
    runner = ModelRunner(loaded.model, num_blocks=16, block_size=8)
    seq = ScheduledSeq("t", tokens, 0, list(range(4)), True, False, 0)
    ids, pos, attn, _ = runner._prepare([seq])
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(ids, pos, attn, runner.kv_caches))


TOKENS = [5, 17, 99, 3, 250, 42, 42, 7, 1, 0, 128, 64]


def test_hf_folder_matches_transformers(tiny_hf):
    folder, ref_model = tiny_hf
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32"), 256)
    with torch.inference_mode():
        ref = ref_model(torch.tensor([TOKENS])).logits[0]
    assert (logits_of(loaded, TOKENS) - ref).abs().max().item() < 1e-4


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (written from its description)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# One quantization type per weight kind, so every loader path is exercised.
QTYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "F16", "attn_output": "BF16",
          "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q5_0", "token_embd": "F32",
          "output": "Q8_0"}
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, state: dict, arch="llama", extra_tensor=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(TINY["hidden_size"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(TINY["num_attention_heads"])
    w.add_head_count_kv(TINY["num_key_value_heads"])
    w.add_rope_freq_base(TINY["rope_theta"])
    w.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    w.add_vocab_size(TINY["vocab_size"])
    for name, t in state.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g, kind = "token_embd.weight", "token_embd"
        elif name == "lm_head.weight":
            g, kind = "output.weight", "output"
        elif name == "model.norm.weight":
            g, kind = "output_norm.weight", None
        else:
            parts = name.split(".")
            sub = ".".join(parts[3:-1])
            kind = HF_TO_GGUF[sub]
            g = f"blk.{parts[2]}.{kind}.weight"
            if kind == "attn_q":
                a = llama_cpp_permute(a, TINY["num_attention_heads"])
            elif kind == "attn_k":
                a = llama_cpp_permute(a, TINY["num_key_value_heads"])
        qtype = QTYPES.get(kind, "F32")
        if qtype in ("F32", "F16"):
            w.add_tensor(g, a.astype(np.float32 if qtype == "F32" else np.float16))
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(g, gguf.quants.quantize(a, qt), raw_dtype=qt)
    if extra_tensor:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_quant_types_and_qk_unpermutation(tiny_hf, tmp_path):
    folder, ref_model = tiny_hf
    state = ref_model.state_dict()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, state)
    loaded = load_model(ModelConfig(model=str(path), dtype="float32"), 256)
    layer = loaded.model.layers[0]
    q = TINY["hidden_size"]
    kv = q // TINY["num_attention_heads"] * TINY["num_key_value_heads"]
    qkv = layer.attn.qkv_proj.weight
    ref_q = state["model.layers.0.self_attn.q_proj.weight"]
    ref_k = state["model.layers.0.self_attn.k_proj.weight"]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    assert rel(qkv[:q], ref_q) < 0.01                     # Q8_0, rows back in HF order
    assert rel(qkv[q:q + kv], ref_k) < 0.01
    assert rel(qkv[q + kv:], state["model.layers.0.self_attn.v_proj.weight"]) < 1e-3   # F16
    assert rel(layer.attn.o_proj.weight, state["model.layers.0.self_attn.o_proj.weight"]) < 0.01
    assert rel(layer.mlp.gate_up_proj.weight[:128],
               state["model.layers.0.mlp.gate_proj.weight"]) < 0.2          # 4-bit
    assert rel(layer.mlp.down_proj.weight, state["model.layers.0.mlp.down_proj.weight"]) < 0.2
    with torch.inference_mode():
        ref = ref_model(torch.tensor([TOKENS])).logits[0]
    ours = logits_of(loaded, TOKENS)
    # 4-bit MLP weights move the logits a little; a wrong Q/K layout moves them a lot.
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item() > 0.95


def kquant_block(kind: str) -> bytes:
    """One hand-built 256-value block whose every value decodes to 1.0 (Q4_K) / -32.0 (Q6_K)."""
    if kind == "Q4_K":
        d, dmin = np.float16(1.0).tobytes(), np.float16(0.0).tobytes()
        scales = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])   # every sub-block scale 1, min 0
        return d + dmin + scales + bytes([0x11] * 128)          # every 4-bit quant = 1
    ql, qh, scales = bytes(128), bytes(64), bytes([1] * 16)      # q = 0 - 32, scale 1
    return ql + qh + scales + np.float16(1.0).tobytes()


@pytest.mark.parametrize("kind,value", [("Q4_K", 1.0), ("Q6_K", -32.0)])
def test_k_quant_tensors_decode(tmp_path, kind, value):
    from tierserve.model.gguf_file import GGUFCheckpoint
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    qt = gguf.GGMLQuantizationType[kind]
    raw = np.frombuffer(kquant_block(kind) * 2, dtype=np.uint8).reshape(2, -1)
    w.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GGUFCheckpoint(str(path))
    name, tensor = next(ckpt.tensors(shape=None))
    assert name == "model.layers.0.mlp.down_proj.weight"
    assert tensor.shape == (2, 256) and torch.all(tensor == value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(ModelConfig(model=str(tmp_path / "nope.gguf")), 64)


def test_corrupt_header_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(ModelConfig(model=str(path)), 64)


def test_unsupported_architecture_gguf(tiny_hf, tmp_path):
    path = tmp_path / "gemma2.gguf"
    write_gguf(path, {}, arch="gemma2")
    with pytest.raises(UnsupportedModelError, match="gemma2"):
        load_model(ModelConfig(model=str(path)), 64)


def test_unsupported_quant_type(tiny_hf, tmp_path):
    folder, ref_model = tiny_hf
    path = tmp_path / "iq.gguf"
    qt = gguf.GGMLQuantizationType.IQ2_XXS
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((1, type_size), dtype=np.uint8)
    write_gguf(path, ref_model.state_dict(), extra_tensor=("blk.9.ffn_up.weight", raw, qt))
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        load_model(ModelConfig(model=str(path)), 64)


def test_hf_folder_errors(tiny_hf, tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(ModelConfig(model=str(tmp_path)), 64)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(ModelConfig(model=str(tmp_path)), 64)
    cfg = json.loads((tiny_hf[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(ModelConfig(model=str(tmp_path)), 64)


def test_dummy_presets():
    from tierserve.model.shapes import PRESETS, preset
    from tierserve.errors import ConfigError
    assert abs(preset("llama-3-8b").num_params / 8.03e9 - 1) < 0.01
    assert abs(preset("llama-3-70b").num_params / 70.6e9 - 1) < 0.01
    assert abs(preset("qwen2.5-7b").num_params / 7.6e9 - 1) < 0.03
    assert abs(preset("smollm2-135m").num_params / 134.5e6 - 1) < 0.01
    assert {"smollm2-135m", "llama-3-8b", "llama-3-70b", "qwen2.5-7b"} <= set(PRESETS)
    with pytest.raises(ConfigError, match="unknown model shape preset"):
        preset("gpt-5")
    loaded = load_model(ModelConfig(model="smollm2-135m", load_format="dummy",
                                    dtype="float32"), 64)
    logits = logits_of(loaded, TOKENS)
    assert logits.shape == (len(TOKENS), 49152) and torch.isfinite(logits).all()


THREADS_AND_QUERIES = [(threads, few) for threads in (1, 2, 3) for few in (1, 3)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128), (4, 4, 64),
                                                (32, 4, 64)])
def test_paged_decode_kernel_matches_torch_attention(dtype, tol, heads, kv_heads, dim):
    """Contexts of one position to several of the AVX2 kernel's 256-position chunks
    (combined as flash-decoding does), the last one partial."""
    from tierserve.model import cpu_attention, kernels
    kernel = kernels.load()
    if kernel is None:
        pytest.skip("no C++ toolchain: the torch path is used instead")
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, batch = 64, 16, 5
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 17, 300, 600, 512])
    width = 38
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width]
                          for _ in range(batch)])
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    out = cpu_attention.paged_decode(kernel, q, k_cache, v_cache, tables, lens)
    keys, values = k_cache[tables].flatten(1, 2), v_cache[tables].flatten(1, 2)
    mask = (torch.arange(width * bs)[None] < lens[:, None])[:, None, None, :]
    g = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.view(batch, kv_heads, g, dim).float(), keys.transpose(1, 2).float(),
        values.transpose(1, 2).float(), attn_mask=mask).reshape(batch, heads, dim)
    assert (out.float() - ref).abs().max().item() < tol
    # fewer queries than twice the threads are split by KV head among the threads: the
    # same numbers as the batch of five, on any number of threads
    for threads, few in THREADS_AND_QUERIES:
        with torch_threads(threads):
            alone = cpu_attention.paged_decode(kernel, q[-few:], k_cache, v_cache,
                                               tables[-few:], lens[-few:])
        assert torch.equal(alone, out[-few:])


@pytest.mark.parametrize("bs", [5, 48])
def test_paged_decode_with_blocks_that_do_not_divide_its_chunks(bs):
    """Block sizes that do not divide the AVX2 kernel's 256 positions: its chunks are whole
    blocks (255 and 240 positions here), contexts around their edges."""
    from tierserve.model import cpu_attention, kernels
    kernel = kernels.load()
    if kernel is None:
        pytest.skip("no C++ toolchain: the torch path is used instead")
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 14, 2, 64     # 7 query heads per KV head
    lens = torch.tensor([1, 239, 240, 255, 256, 700])
    width = -(-700 // bs)
    num_blocks = width + 9
    k_cache, v_cache = (torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
                        .to(torch.bfloat16) for _ in "kv")
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(torch.bfloat16)
    out = cpu_attention.paged_decode(kernel, q, k_cache, v_cache, tables, lens)
    keys, values = k_cache[tables].flatten(1, 2), v_cache[tables].flatten(1, 2)
    mask = (torch.arange(width * bs)[None] < lens[:, None])[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.view(len(lens), kv_heads, heads // kv_heads, dim).float(),
        keys.transpose(1, 2).float(), values.transpose(1, 2).float(),
        attn_mask=mask).reshape(len(lens), heads, dim)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128), (4, 4, 64),
                                                (32, 4, 64)])
def test_paged_decode_on_an_int8_cache_matches_attention_over_its_values(dtype, tol, heads,
                                                                         kv_heads, dim):
    """--kv-cache-dtype int8: int8 keys and values, a float32 scale per position and KV
    head. The kernel's answer is attention over the values those stand for (bfloat16
    queries take integer dot products: each query head rounded to int8 on its own scale,
    the probabilities to int16)."""
    from tierserve.model import cpu_attention, kernels
    kernel = kernels.load()
    if kernel is None:
        pytest.skip("no C++ toolchain: the torch path is used instead")
    gen = torch.Generator().manual_seed(1)
    num_blocks, bs, batch = 64, 16, 5

    def int8_cache():
        x = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
        x[::5, :, 0] = 0            # some all-zero heads: scale 0
        scale = x.abs().amax(-1) / 127
        return torch.round(x / scale[..., None]).to(torch.int8), scale

    (k8, ks), (v8, vs) = int8_cache(), int8_cache()
    width, lens = 38, torch.tensor([1, 17, 300, 600, 3])   # several 256-position chunks
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width]
                          for _ in range(batch)])
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    out = cpu_attention.paged_decode(kernel, q, k8, v8, tables, lens, ks, vs)
    keys = (k8.float() * ks[..., None])[tables].flatten(1, 2)
    values = (v8.float() * vs[..., None])[tables].flatten(1, 2)
    mask = (torch.arange(width * bs)[None] < lens[:, None])[:, None, None, :]
    g = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.view(batch, kv_heads, g, dim).float(), keys.transpose(1, 2),
        values.transpose(1, 2), attn_mask=mask).reshape(batch, heads, dim)
    assert (out.float() - ref).abs().max().item() < tol
    for threads, few in THREADS_AND_QUERIES:
        with torch_threads(threads):
            alone = cpu_attention.paged_decode(kernel, q[-few:], k8, v8, tables[-few:],
                                               lens[-few:], ks, vs)
        assert torch.equal(alone, out[-few:])
    with pytest.raises(RuntimeError, match="int8 cache needs its scales"):
        cpu_attention.paged_decode(kernel, q, k8, v8, tables, lens)


@pytest.mark.parametrize("model", ["default", "gemma3-270m"])
def test_the_gateways_tokenizer_gives_the_engines_ids(model, tmp_path):
    """A fleet gateway counts and renders with `tokenizers` and jinja2 (no transformers,
    no torch); it must give the same ids and the same chat text as the engine's."""
    from tierserve.model.metadata import default_model_path, model_path
    from tierserve.model.tokenizer import Tokenizer

    source = str(default_model_path()) if model == "default" else model
    try:
        model_path(source)
    except ModelLoadError as exc:  # gemma's package is installed by `make install`
        pytest.skip(f"{model} not installed: {exc}")
    engine, gateway = Tokenizer.load(source), Tokenizer.for_gateway(source)
    texts = ["Hello, world!", "  spaces\tand\nnewlines  ", "émigré naïve 東京 🙂", ""]
    for text in texts:
        assert gateway.encode(text) == engine.encode(text)
        assert gateway.encode(text, add_special_tokens=False) == \
            engine.encode(text, add_special_tokens=False)
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "Name a colour."}]]
    assert gateway.has_chat_template == engine.has_chat_template
    for messages in chats if engine.has_chat_template else ():
        assert gateway.apply_chat_template(messages) == engine.apply_chat_template(messages)
    ids = engine.encode("round trip, of text")
    assert gateway.decode(ids) == engine.decode(ids)
    assert gateway.eos_token_id == engine.eos_token_id
    assert gateway.vocab_size == engine.vocab_size
