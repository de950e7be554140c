"""Decode step time and memory per weight format (--quantization), side by side in one run.

    python benchmarks/quant_speed.py [--concurrency 1,4,16] [--rounds 5] [--kv-cache-memory-gb 1]
                                     [--bf16-head] [--memory-only]

Speed: one bfloat16 engine per format on the default model (SmolLM2-135M, Q4_1 GGUF), each
holding `c` sequences of 128 prompt tokens in decode; the formats take turns, `--steps`
timed engine steps each per round, so a noisy neighbour hits them alike. Prints the
median step per format and its ratio to bf16, then a 512-token prefill step the same way.

Memory: the weights' bytes as held (measured), and with `--kv-cache-memory-gb` fixed how
many sequences of 128 + 128 tokens fit: the KV pool does not depend on the weight format,
so also how many fit when weights and KV share one budget (bf16 weights + the KV memory
for SmolLM2; 24 GiB for llama-3-8b, whose bytes are computed from its shape by the
formula checked here against the measured SmolLM2 bytes).
"""

import argparse
import platform
import random
import statistics
import sys
import time

FORMATS = ("none", "int8", "gguf")


def start_decoding(engine, c: int, prompt_len: int, seed: int) -> list[str]:
    """`c` requests, run until every one has its first token (all in decode)."""
    from tierserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    ids = [engine.add_request(None, [rng.randrange(100, engine.shape.vocab_size)
                                     for _ in range(prompt_len)], params) for _ in range(c)]
    started: set[str] = set()
    while len(started) < c:
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    return ids


def timed_steps(engine, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t)
    return out


def decode_times(engines: dict, c: int, rounds: int, steps: int, seed: int) -> dict:
    ids = {f: start_decoding(e, c, 128, seed) for f, e in engines.items()}
    times = {f: [] for f in engines}
    for f, e in engines.items():
        timed_steps(e, 2)                                          # warm
    for _ in range(rounds):
        for f, e in engines.items():
            times[f] += timed_steps(e, steps)
    for f, e in engines.items():
        for rid in ids[f]:
            e.abort_request(rid)
    return {f: statistics.median(t) for f, t in times.items()}


def prefill_times(engines: dict, rounds: int, seed: int) -> dict:
    """One 512-token prompt alone in a step (prefix caching off: a fresh prompt each)."""
    from tierserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = {f: [] for f in engines}
    for _ in range(rounds):
        prompt = [rng.randrange(100, 40000) for _ in range(512)]
        for f, e in engines.items():
            e.add_request(None, list(prompt), params)
            t = time.perf_counter()
            while e.has_unfinished_requests():
                e.step()
            times[f].append(time.perf_counter() - t)
    return {f: statistics.median(t) for f, t in times.items()}


def format_bytes(shape, fmt: str) -> int:
    """Weight bytes as tierserve holds them (bfloat16 activations), from the shape alone:
    bf16 linears oneDNN-packed and a tied head packed beside the lookup table; int8 one
    byte a weight and a bf16 scale a row; int4 half a byte and a (s, z) pair per 32; the
    head int8 in both, and a tied table held once as int8."""
    h, v = shape.hidden_size, shape.vocab_size
    layer_linears = [(shape.q_size + 2 * shape.kv_size, h), (h, shape.q_size),
                     (2 * shape.intermediate_size, h), (h, shape.intermediate_size)]
    norms = shape.num_layers * 2 * h * 2 + 2 * h
    if fmt == "none":
        per = sum(n * k * 2 for n, k in layer_linears)
        head = 2 * (v * h * 2)          # lookup table + head (tied: its packed copy)
    else:
        per = sum(n * k + 2 * n if fmt == "int8" else n * k // 2 + n * k // 32 * 4
                  for n, k in layer_linears)
        head = v * h + 2 * v + (0 if shape.tie_word_embeddings else 2 * v * h)
    return shape.num_layers * per + head + norms


def memory_lines(engines: dict, kv_gb: float, block_size: int) -> list[str]:
    from tierserve.model.quant import weight_bytes
    from tierserve.model.shapes import preset

    lines = []
    seq_blocks = -(-256 // block_size)
    for name, shape, measured, budget_gb in (
            ("smollm2-135m", next(iter(engines.values())).shape, True, None),
            ("llama-3-8b", preset("llama-3-8b"), False, 24.0)):
        kv_seq = shape.kv_bytes_per_token(2) * block_size * seq_blocks
        fixed_seqs = int(kv_gb * 2**30 // (shape.kv_bytes_per_token(2) * block_size)) // seq_blocks
        bf16 = format_bytes(shape, "none")
        budget = budget_gb * 2**30 if budget_gb else bf16 + kv_gb * 2**30
        for fmt in FORMATS:
            computed = format_bytes(shape, fmt)
            held = weight_bytes(engines[fmt].runner.model) if measured else computed
            note = f"measured (formula {computed / 1e6:.1f} MB)" if measured else "computed"
            lines.append(
                f"memory model={name} quantization={fmt} weights={held / 1e6:.1f} MB [{note}] "
                f"kv_cache_memory_gb={kv_gb} seqs_128+128={fixed_seqs} | "
                f"budget={budget / 2**30:.2f} GiB weights+KV -> "
                f"seqs_128+128={int((budget - held) // kv_seq)}")
    return lines


def make_engine(fmt: str, args, lm_head: bool = True, kv_cache_dtype: str = "auto"):
    from unittest import mock

    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.model.gguf_quant import quantize_model

    config = engine_config(
        dtype="bfloat16", quantization=fmt, kv_cache_memory_gb=args.kv_cache_memory_gb,
        block_size=args.block_size, priority_step_time_s=0, enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype)
    if lm_head:
        return LLMEngine(config)
    # No flag keeps the head in bfloat16 (the default quantizes it): the loader's call
    # is wrapped for this comparison only.
    with mock.patch("tierserve.model.loader.quantize_model",
                    lambda *a, **k: quantize_model(*a, **k, lm_head=False)):
        return LLMEngine(config)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed steps per format per round")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--memory-only", action="store_true")
    p.add_argument("--bf16-head", action="store_true",
                   help="also int8 and gguf with the lm_head kept bfloat16 (decode only)")
    args = p.parse_args(argv)
    import torch

    engines = {f: make_engine(f, args) for f in FORMATS}
    if args.bf16_head:
        engines |= {f"{f}/bf16-head": make_engine(f, args, lm_head=False) for f in FORMATS[1:]}
    print(f"# machine={platform.machine()} threads={torch.get_num_threads()} "
          f"torch={torch.__version__} model={engines['none'].loaded.source} dtype=bfloat16 "
          f"rounds={args.rounds} steps={args.steps} seed={args.seed}", flush=True)
    if not args.memory_only:
        for c in (int(x) for x in args.concurrency.split(",")):
            t = decode_times(engines, c, args.rounds, args.steps, args.seed + c)
            print(f"decode concurrency={c} prompt=128 | " + " | ".join(
                f"{f} {t[f] * 1e3:.1f} ms ({t['none'] / t[f]:.2f}x)" for f in engines),
                flush=True)
        t = prefill_times({f: engines[f] for f in FORMATS}, max(2, args.rounds // 2), args.seed)
        print("prefill 512 tokens | " + " | ".join(
            f"{f} {t[f] * 1e3:.0f} ms ({t['none'] / t[f]:.2f}x)" for f in FORMATS), flush=True)
    for line in memory_lines(engines, args.kv_cache_memory_gb, args.block_size):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
