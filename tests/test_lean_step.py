"""The lean step (model/cpu_step.py): the whole forward pass in one C++ call must compute
what the Python model computes, in every kind of step the scheduler makes."""

import random

import pytest
import torch

from conftest import generate, get_engine
from tierserve.model import cpu_step, kernels
from tierserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C++ toolchain")


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 40, 130, 7, 200)]
    prompts.append(prompts[2][:96] + [11, 12, 13])      # continues a cached prefix
    return prompts


def _compare_steps(engine, decodes_only: bool = False) -> tuple[float, float, set[str]]:
    """Run a mixed workload; at every step compute the hidden states both ways (Python
    first, then lean, which rewrites the same K/V) and return the worst relative error of
    the hidden states, the worst mean KL divergence of the next-token distributions (Python
    path to lean) and the kinds of step seen."""
    runner, model = engine.runner, engine.runner.model
    assert runner.lean is not None
    worst, worst_kl, kinds, step = 0.0, 0.0, set(), {}
    original, lean, execute = model.forward, runner.lean, runner.execute

    def scheduled(output):
        """The step's kind, from what was scheduled: in the lean step over a bfloat16 cache
        every row is a query of the paged kernel, prompt rows too (ModelRunner._paged)."""
        prompts = [s for s in output.seqs if not s.is_decode]
        step["kind"] = ("decode" if not prompts else
                        "mixed" if len(prompts) < len(output.seqs) else "prefill")
        step["cached"] = any(s.start_pos > 0 for s in prompts)
        return execute(output)

    def both(input_ids, positions, attn, kv_caches):
        ref = original(input_ids, positions, attn, kv_caches)
        out = lean(model.embed(input_ids), positions, attn)
        nonlocal worst, worst_kl
        if decodes_only and step["kind"] != "decode":
            return ref
        worst = max(worst, float((out - ref).float().norm() / ref.float().norm()))
        p = torch.log_softmax(model.compute_logits(ref), -1)
        q = torch.log_softmax(lean.logits(out), -1)          # the lean step's own head
        worst_kl = max(worst_kl, float((p.exp() * (p - q)).sum(-1).mean()))
        kinds.add(step["kind"])
        if step["cached"]:
            kinds.add("cached-context chunk")
        return ref

    runner.lean = None                  # route the runner through model.forward: `both`
    model.forward = both
    runner.execute = scheduled
    try:
        generate(engine, _prompts(0), SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True))
    finally:
        del model.forward, runner.execute
        runner.lean = lean
    return worst, worst_kl, kinds


def test_lean_step_matches_the_python_model_in_float32():
    engine = get_engine(max_num_batched_tokens=64, kv_cache_memory_gb=0.5)
    worst, worst_kl, kinds = _compare_steps(engine)
    assert kinds >= {"decode", "mixed", "prefill", "cached-context chunk"}
    # float32 summation order: about 1e-5 and 2e-7 measured
    assert worst < 1e-4 and worst_kl < 1e-5


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_lean_decode_steps_in_bfloat16_agree_to_rounding(quantization):
    """bf16 rounds differently (the fused loops round once, torch after each op), so the
    paths agree to bf16 precision, not bit for bit. Decode steps are compared here; a
    prefill's first positions on random tokens are so sensitive that both paths stray
    from float32 by a KL of 2-5 there, so prefills are judged against float32 below."""
    engine = get_engine(dtype="bfloat16", quantization=quantization,
                        max_num_batched_tokens=128, kv_cache_memory_gb=0.25)
    _, worst_kl, kinds = _compare_steps(engine, decodes_only=True)
    assert "decode" in kinds and worst_kl < 0.02          # about 0.007 measured


TEXT = ("The lighthouse keeper's log for that winter is mostly about weather: wind from the "
        "north-east for nine days, then a calm so complete that the fog sat on the water. "
        "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(min(a, b))\n"
        "Seven squared is 49, eight squared is 64, and nine squared is 81. ") * 3


def test_lean_prefill_is_as_close_to_float32_as_the_python_path():
    """Teacher-forced next-token distributions over real text, against the float32 model:
    the lean step's mean KL divergence is no worse than the Python path's in bf16, with the
    prompt's attention by torch's SDPA and by the paged kernel (each position a query over
    its own context, as the engine's lean step computes prefill chunks). With the GGUF
    file's 4-bit weights the lean kernel rounds each layer's inputs to int8 per group of 32
    (as llama.cpp does), which may cost a little: at most 0.003 more (about 0.0014
    measured, against about 0.002 for the 4-bit weights themselves)."""
    from tierserve.model.cpu_linear import pack_linears, unpacked_copy
    from tierserve.model.gguf_quant import quantize_model
    from tierserve.model.llama import AttentionMetadata

    engine = get_engine(max_num_batched_tokens=64, kv_cache_memory_gb=0.5)
    ref = engine.runner.model
    tokens = engine.tokenizer.encode(TEXT)[:256]
    T, shape = len(tokens), ref.shape
    attn = AttentionMetadata.one_sequence(T)
    paged = AttentionMetadata.one_sequence(T, kernels.load())
    assert engine.runner.paged_prefill      # what the engine does with this prompt

    def log_probs(model, lean: bool, attn=attn):
        dtype = next(model.parameters()).dtype
        caches = [(torch.zeros(-(-T // 16), 16, shape.num_kv_heads, shape.head_dim, dtype=dtype),
                   torch.zeros(-(-T // 16), 16, shape.num_kv_heads, shape.head_dim, dtype=dtype))
                  for _ in range(shape.num_layers)]
        ids = torch.tensor(tokens)
        with torch.inference_mode():
            hidden = (cpu_step.LeanForward(kernels.load(), model, caches)(
                model.embed(ids), torch.arange(T), attn) if lean
                else model(ids, torch.arange(T), attn, caches))
            return torch.log_softmax(model.compute_logits(hidden), -1)

    p = log_probs(ref, False)
    for method in (None, "gguf"):
        model = unpacked_copy(ref).to(torch.bfloat16)
        if method:
            quantize_model(model, method, engine.loaded.source)
        pack_linears(model)
        kl = {lean: float((p.exp() * (p - log_probs(model, lean))).sum(-1).mean())
              for lean in (False, True)}
        kl["paged"] = float((p.exp() * (p - log_probs(model, True, paged))).sum(-1).mean())
        allowance = 0.003 if method == "gguf" else 1e-4
        assert max(kl[True], kl["paged"]) <= kl[False] * 1.1 + allowance, (method, kl)


def test_lean_and_python_paths_generate_the_same_text():
    engine = get_engine(max_num_batched_tokens=64, kv_cache_memory_gb=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    lean = [o.outputs[0].token_ids for o in generate(engine, _prompts(1), params)]
    saved, engine.runner.lean = engine.runner.lean, None
    try:
        plain = [o.outputs[0].token_ids for o in generate(engine, _prompts(1), params)]
    finally:
        engine.runner.lean = saved
    assert lean == plain


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_a_burst_s_prompts_in_one_attention_call_are_computed_as_one_by_one(quantization):
    """Fresh prefill chunks of one length side by side (a burst of equal prompts) go to
    SDPA in one call: the step's hidden states and the K/V written are the same, bit for
    bit, as with a call per chunk. Chunks of 70 and 130 tokens: torch's flash kernel
    takes other paths from 64 positions on."""
    from torch.profiler import profile

    from tierserve.model.llama import AttentionMetadata, PrefillChunk

    engine = get_engine(dtype="bfloat16", quantization=quantization,
                        max_num_batched_tokens=128, kv_cache_memory_gb=0.25)
    model, shape = engine.runner.model, engine.runner.model.shape
    rng = random.Random(5)
    lengths = [130, 130, 9, 70, 70, 70]        # a run of two, one apart, a run of three
    ids = torch.tensor([rng.randrange(100, 40000) for _ in range(sum(lengths))])
    ends = [sum(lengths[:i + 1]) for i in range(len(lengths))]
    chunks = [PrefillChunk(e - n, e, None, None) for e, n in zip(ends, lengths)]
    T = len(ids)
    positions = torch.cat([torch.arange(n) for n in lengths])
    attn = AttentionMetadata(slot_mapping=torch.arange(T), num_decodes=0,
                             decode_block_tables=None, decode_mask=None,
                             decode_context_lens=None, prefills=chunks)

    dtype = engine.runner.dtype   # float32 on a CPU without a bfloat16 matmul (AVX2)

    def run(group: bool):
        caches = [(torch.zeros(-(-T // 16), 16, shape.num_kv_heads, shape.head_dim,
                               dtype=dtype),
                   torch.zeros(-(-T // 16), 16, shape.num_kv_heads, shape.head_dim,
                               dtype=dtype)) for _ in range(shape.num_layers)]
        lean = cpu_step.LeanForward(kernels.load(), model, caches)
        lean.impl.group_chunks = group
        with torch.inference_mode(), profile() as prof:
            hidden = lean(model.embed(ids), positions, attn)
        calls = sum(e.count for e in prof.key_averages()
                    if e.key == "aten::scaled_dot_product_attention")
        return hidden, caches, calls

    (grouped, kv_grouped, n_grouped), (alone, kv_alone, n_alone) = run(True), run(False)
    assert (n_grouped, n_alone) == (3 * shape.num_layers, 6 * shape.num_layers)
    assert torch.equal(grouped, alone)
    assert all(torch.equal(a, b) for pa, pb in zip(kv_grouped, kv_alone)
               for a, b in zip(pa, pb))


def test_wide_inputs_dequantize_4_bit_weights_in_cpp_as_torch_does():
    """Without AVX-512 VNNI, above 96 rows (a prefill) the lean step dequantizes a 4-bit
    layer once, in C++, and runs one dense matmul: the matrix must be the one quant.py's
    torch ops compute."""
    from tierserve.model.quant import GROUP_SIZE, QuantLinear, _int4_layout_known

    if not _int4_layout_known():
        pytest.skip("torch packs int4 for this CPU (no AVX-512) in a layout quant.py does "
                    "not read: its layers keep torch's kernel at every width")
    gen = torch.Generator().manual_seed(3)
    n, k = 192, 6 * GROUP_SIZE
    layer = QuantLinear.int4(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                             torch.rand(n, k // GROUP_SIZE, generator=gen) / 8,
                             -torch.rand(n, k // GROUP_SIZE, generator=gen))
    assert layer.use_kernel and layer.readable and layer.dequant_rows == 96
    want = layer.dequantize()
    got = kernels.load().dequantize_int4_t(layer.weight, layer.scales, layer.group_size).t()
    # float32 then one rounding in both; a fused multiply-add may move the last bit
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-8).all()
    assert (got == want).float().mean() > 0.999


def test_wide_steps_run_a_bfloat16_copy_of_the_integer_layers_where_the_cpu_has_amx(
        monkeypatch):
    """On a CPU with AMX the lean step also holds each 4- and 8-bit layer's weight in
    bfloat16, packed by oneDNN, for inputs of more than DENSE_ROWS rows. Up to that width
    a step is the integer kernels', bit for bit; above it, the body and the head compute
    what the Python layers compute (bfloat16 activations, not rounded to int8), closer to
    them than the integer kernels. AMX is faked where absent: oneDNN packs the same way."""
    from tierserve.model.cpu_linear import packs_bf16
    from tierserve.model.llama import AttentionMetadata

    if not packs_bf16() or not kernels.load().int4_vnni:
        pytest.skip("no copies are made (oneDNN packs no bfloat16 here), or the layers they "
                    "stand for run torch's kernels, which keep bfloat16 activations too")
    engine = get_engine(dtype="bfloat16", quantization="gguf", max_num_batched_tokens=128,
                        kv_cache_memory_gb=0.25)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    model, shape = engine.runner.model, engine.runner.model.shape
    tokens = engine.tokenizer.encode(TEXT)

    def lean_forward(copies: bool, T: int):
        if copies:
            monkeypatch.delenv("TIERSERVE_NO_DENSE_COPY", raising=False)
        else:
            monkeypatch.setenv("TIERSERVE_NO_DENSE_COPY", "1")
        caches = [tuple(torch.zeros(-(-T // 16), 16, shape.num_kv_heads, shape.head_dim,
                                    dtype=torch.bfloat16) for _ in "kv")
                  for _ in range(shape.num_layers)]
        lean = cpu_step.LeanForward(kernels.load(), model, caches)
        assert (lean.dense_bytes > 0) == copies
        return lean, caches

    def hidden(T: int, copies: bool | None):
        """The prompt's final hidden states: lean with or without copies, None: Python."""
        lean, caches = lean_forward(bool(copies), T)
        ids, pos = torch.tensor(tokens[:T]), torch.arange(T)
        attn = AttentionMetadata.one_sequence(T, kernels.load())
        with torch.inference_mode():
            return model(ids, pos, attn, caches) if copies is None else \
                lean(model.embed(ids), pos, attn)

    err = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    narrow, wide = cpu_step.DENSE_ROWS, 3 * cpu_step.DENSE_ROWS
    h = hidden(narrow, True)
    assert torch.equal(h, hidden(narrow, False))
    head = {c: lean_forward(c, 1)[0] for c in (True, False)}
    assert torch.equal(head[True].logits(h), head[False].logits(h))

    h_copy, h_int, h_py = hidden(wide, True), hidden(wide, False), hidden(wide, None)
    assert not torch.equal(h_copy, h_int)
    assert err(h_copy, h_py) < 0.75 * err(h_int, h_py), (err(h_copy, h_py), err(h_int, h_py))
    with torch.inference_mode():
        want = model.compute_logits(h_py).float()
    got = {c: err(head[c].logits(h_py), want) for c in (True, False)}
    assert got[True] < 0.5 * got[False], got


def test_gemma_keeps_the_python_path():
    from tierserve.model.shapes import preset
    shape = preset("gemma3-270m")
    assert not cpu_step.supports(shape)
    assert cpu_step.supports(preset("llama-3-8b"))


def test_no_kernels_means_no_lean_step(monkeypatch):
    """TIERSERVE_NO_KERNELS=1 (or no compiler): the runner uses the Python model."""
    from tierserve.worker.model_runner import ModelRunner

    monkeypatch.setattr(kernels, "load", lambda: None)
    engine = get_engine(max_num_batched_tokens=64, kv_cache_memory_gb=0.5)
    runner = ModelRunner(engine.runner.model, num_blocks=8, block_size=16)
    assert runner.lean is None and runner.decode_kernel is None


def test_an_int8_kv_cache_keeps_each_head_within_half_a_step_of_its_scale():
    """--kv-cache-dtype int8: each position's key and value heads are written as int8 with
    one float32 scale, the head's largest magnitude / 127, so every value comes back
    within half a step of what the bfloat16 cache holds; prompts that continue a cached
    context read it back through the same scales."""
    engine = get_engine(dtype="bfloat16", max_num_batched_tokens=64, kv_cache_memory_gb=0.25)
    model, shape = engine.runner.model, engine.runner.model.shape
    tokens = engine.tokenizer.encode(TEXT)[:96]
    T = len(tokens)
    from tierserve.model.llama import AttentionMetadata, PrefillChunk

    def prefill(kv_cache_dtype):
        caches = cpu_step.new_kv_caches(shape, -(-T // 16), 16, engine.runner.dtype,
                                        kv_cache_dtype)
        lean = cpu_step.LeanForward(kernels.load(), model, caches)
        first = AttentionMetadata(torch.arange(48), 0, None, None, None,
                                  [PrefillChunk(0, 48, None, None)])
        blocks = torch.arange(-(-T // 16))
        mask = torch.arange(len(blocks) * 16)[None] <= torch.arange(48, T)[:, None]
        rest = AttentionMetadata(torch.arange(48, T), 0, None, None, None,
                                 [PrefillChunk(0, T - 48, blocks, mask)])
        with torch.inference_mode():
            lean(model.embed(torch.tensor(tokens[:48])), torch.arange(48), first)
            hidden = lean(model.embed(torch.tensor(tokens[48:])), torch.arange(48, T), rest)
            return caches, torch.log_softmax(lean.logits(hidden), -1)

    (plain, p), (quantized, q) = prefill("auto"), prefill("int8")
    # layer 0's keys and values come from the embeddings alone, the same in both runs
    (k, v), (k8, v8, ks, vs) = plain[0], quantized[0]
    for exact, ints, scales in ((k, k8, ks), (v, v8, vs)):
        exact = exact.float()
        assert torch.allclose(scales, exact.abs().amax(-1) / 127, rtol=1e-6, atol=0)
        assert ((ints.float() * scales[..., None] - exact).abs()
                <= scales[..., None] * 0.5001).all()
    # deeper layers (their inputs attended through the int8 values): every head on its
    # own full scale
    for _, _, ks, vs in quantized[1:]:
        assert (ks > 0).all() and (vs > 0).all()
    for k8, v8, _, _ in quantized:
        for ints in (k8, v8):
            assert (ints.abs().amax(-1) == 127).all()
    # the second chunk attended to the first through the int8 cache: close to bf16's
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert kl < 0.01 and (p.argmax(-1) == q.argmax(-1)).float().mean() >= 0.9


def test_decoding_from_an_int8_kv_cache_stays_close_to_bfloat16():
    """The paged decode kernel on the int8 cache (integer dot products where the CPU has
    them): teacher-forced over real text, one token per step as the engine decodes, the
    next-token distributions stay close to those from the bfloat16 cache (over the whole
    benchmark text the int8 cache added a mean KL of 0.0009 against float32,
    docs/benchmarks.md)."""
    engine = get_engine(dtype="bfloat16", max_num_batched_tokens=64, kv_cache_memory_gb=0.25)
    tokens = engine.tokenizer.encode(TEXT)[:128]
    p, q = (torch.log_softmax(cpu_step.decode_logits(
        kernels.load(), engine.runner.model, tokens, kv), -1) for kv in ("auto", "int8"))
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert kl < 0.01 and (p.argmax(-1) == q.argmax(-1)).float().mean() >= 0.9


def test_an_int8_kv_cache_holds_nearly_twice_the_tokens_and_serves_every_kind_of_step(
        monkeypatch):
    """The int8 engine's every step (prefill, mixed, decode, a chunk continuing cached
    context) is replayed on a lean step with a bfloat16 cache of the same blocks: the
    next-token distributions stay close in each kind of step, closest for decodes."""
    from tierserve.errors import ConfigError
    from tierserve.worker.model_runner import ModelRunner

    auto = get_engine(dtype="bfloat16", max_num_batched_tokens=64, kv_cache_memory_gb=0.25)
    int8 = get_engine(dtype="bfloat16", max_num_batched_tokens=64, kv_cache_memory_gb=0.25,
                      kv_cache_dtype="int8")
    # SmolLM2: 2 x 192 bf16 values a token and layer (float32 ones on a CPU without a
    # bfloat16 matmul, where bfloat16 computes in float32) against 2 x (192 + 3 scales x 4
    # bytes)
    dtype = auto.runner.dtype
    assert int8.block_manager.num_blocks == pytest.approx(
        auto.block_manager.num_blocks * 2 * 192 * dtype.itemsize / 408, rel=0.001)
    model = int8.runner.model
    shadow = cpu_step.LeanForward(kernels.load(), model, cpu_step.new_kv_caches(
        model.shape, int8.block_manager.num_blocks, int8.runner.block_size, dtype))
    worst: dict[str, float] = {}
    forward = cpu_step.LeanForward.__call__

    def both(self, h, positions, attn):
        out = forward(self, h.clone(), positions, attn)
        if self is shadow:
            return out
        ref = forward(shadow, h.clone(), positions, attn)
        p = torch.log_softmax(shadow.logits(ref), -1)
        q = torch.log_softmax(self.logits(out), -1)
        kinds = ["decode" if attn.num_decodes == len(positions) else
                 "mixed" if attn.num_decodes else "prefill"]
        if any(c.block_table is not None for c in attn.prefills):
            kinds.append("cached-context chunk")
        kl = (p.exp() * (p - q)).sum(-1)
        D = attn.num_decodes
        if D:
            worst["decode rows"] = max(worst.get("decode rows", 0.0), float(kl[:D].mean()))
        for kind in kinds:
            worst[kind] = max(worst.get(kind, 0.0), float(kl.mean()))
        return out

    monkeypatch.setattr(cpu_step.LeanForward, "__call__", both)
    outs = generate(int8, _prompts(0), SamplingParams(temperature=0.0, max_tokens=8,
                                                      ignore_eos=True))
    assert set(worst) >= {"decode", "mixed", "prefill", "cached-context chunk"}
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # decodes (as the decode test above): about 0.005 measured. Prompt rows of random
    # tokens are far more sensitive to any rounding (see the bf16 test above): 0.008-0.065
    # measured, where a cache read wrongly (scales ignored, say) gives several.
    assert worst["decode rows"] < 0.02 and max(worst.values()) < 0.2, worst
    # where the Python layers run (no kernels, Gemma, a GPU) the flag is refused
    monkeypatch.setattr(kernels, "load", lambda: None)
    with pytest.raises(ConfigError, match="kv-cache-dtype int8 needs the lean CPU step"):
        ModelRunner(auto.runner.model, num_blocks=8, block_size=16, kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="kv-cache-dtype int8 needs the lean CPU step"):
        get_engine(dtype="bfloat16", kv_cache_memory_gb=0.25, kv_cache_dtype="int8",
                   max_num_batched_tokens=32)   # refused before any weight loads


def test_step_parts_finds_the_lean_forwards_parts_or_says_which_it_lost(monkeypatch):
    """benchmarks/step_parts.py times the lean forward's parts by rewriting its source at
    fixed statements: each must still be there once, and one that is gone is named."""
    from pathlib import Path

    from conftest import load_benchmark

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    step_parts = load_benchmark("step_parts")
    source = kernels.source()
    timed = step_parts.instrumented(source)
    for i in range(len(step_parts.PARTS)):   # each part's clock, once
        assert timed.count(f"TS_PARTS[{i}] +=") == 1
    assert 'm.def("ts_parts"' in timed
    lost = "m = lin[3](act).contiguous();"
    with pytest.raises(SystemExit, match=r"no longer holds `m = lin\[3\]"):
        step_parts.instrumented(source.replace(lost, "m = lin[3](act);"))
