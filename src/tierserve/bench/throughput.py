"""Offline throughput: fixed-length prompts and outputs at several concurrencies.

For each concurrency c, `requests` requests run closed-loop through LLMEngine with at most c
in flight (a new one starts when one finishes). The same prompts then run through
transformers `generate` in static batches of c on the same weights, and the ratio is
printed. One line per configuration; the config is echoed on it.
"""

import argparse
import platform
import random
import statistics
import time

from tierserve.core.stats import StatsCollector


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,4,16,64",
                   help="comma-separated concurrencies (default 1,4,16,64)")
    p.add_argument("--requests", default=None,
                   help="comma-separated request counts per concurrency "
                        "(default max(4, 2 x concurrency))")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bench-seed", type=int, default=1234, help="seed of the prompt tokens")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--mem-bw-gbs", type=float, default=30.0,
                   help="memory bandwidth for the physical-limit estimate (GB/s)")
    p.add_argument("--matmul-gflops", type=float, default=None,
                   help="matmul rate for the estimate (default 399 bf16, 174 fp32)")


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_engine(engine, prompts, output_len: int, concurrency: int) -> dict:
    from tierserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    collector = StatsCollector()
    engine.add_sink(collector)
    todo = list(prompts)
    start = time.perf_counter()
    while todo or engine.has_unfinished_requests():
        while todo and engine.num_unfinished_requests < concurrency:
            engine.add_request(None, todo.pop(0), params)
        engine.step()
    wall = time.perf_counter() - start
    engine.remove_sink(collector)
    reqs = collector.requests
    itl = [x for r in reqs for x in r.inter_token_s]
    return {
        "tok_s": sum(r.num_output_tokens for r in reqs) / wall,
        "step_ms": 1000 * statistics.mean(s.duration_s for s in collector.steps),
        "ttft_p50_ms": 1000 * statistics.median(r.ttft_s for r in reqs),
        "itl_p50_ms": 1000 * statistics.median(itl) if itl else float("nan"),
        "wall_s": wall,
    }


def run_hf(model_path: str, dtype: str, prompts, output_len: int, concurrency: int) -> float:
    import torch

    model = _hf_model(model_path, dtype)
    start = time.perf_counter()
    total = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), concurrency):
            batch = torch.tensor(prompts[i:i + concurrency])
            out = model.generate(batch, attention_mask=torch.ones_like(batch),
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0)
            total += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    return total / (time.perf_counter() - start)


_HF_CACHE: dict = {}


def _hf_model(path: str, dtype: str):
    import os

    import torch
    import transformers

    if (path, dtype) not in _HF_CACHE:
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        folder, name = os.path.split(os.path.abspath(path))
        kwargs = {"gguf_file": name} if not os.path.isdir(path) else {}
        _HF_CACHE[(path, dtype)] = transformers.AutoModelForCausalLM.from_pretrained(
            folder if kwargs else path, dtype=getattr(torch, dtype), **kwargs).eval()
    return _HF_CACHE[(path, dtype)]


def physical_limits(shape, dtype: str, mem_bw_gbs: float, gflops: float) -> str:
    bytes_per = 4 if dtype == "float32" else 2
    weight_bytes = shape.num_params * bytes_per
    step_floor_ms = 1000 * weight_bytes / (mem_bw_gbs * 1e9)
    flops_per_token = 2 * shape.num_params
    max_tok_s = gflops * 1e9 / flops_per_token
    return (f"limits: weights {weight_bytes / 1e6:.0f} MB/step at {mem_bw_gbs:.0f} GB/s -> "
            f"decode step >= {step_floor_ms:.1f} ms (<= {1000 / step_floor_ms:.0f} tok/s at c=1); "
            f"{flops_per_token / 1e6:.0f} MFLOP/token at {gflops:.0f} GFLOP/s -> "
            f"<= {max_tok_s:.0f} tok/s batched")


def run(args) -> None:
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.engine_args import engine_config_from_args

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    counts = ([int(n) for n in args.requests.split(",")] if args.requests
              else [max(4, 2 * c) for c in concurrencies])
    engine = LLMEngine(engine_config_from_args(args))
    gflops = args.matmul_gflops or (174.0 if args.dtype == "float32" else 399.0)
    print(f"# machine={platform.machine()} {platform.processor() or ''} model="
          f"{engine.loaded.source} dtype={args.dtype} "
          + physical_limits(engine.shape, args.dtype, args.mem_bw_gbs, gflops), flush=True)
    vocab = engine.shape.vocab_size
    warm = make_prompts(2, args.prompt_len, vocab, args.bench_seed + 1)
    run_engine(engine, warm, 8, 2)
    for c, n in zip(concurrencies, counts):
        prompts = make_prompts(n, args.prompt_len, vocab, args.bench_seed + c)
        res = run_engine(engine, prompts, args.output_len, c)
        line = (f"throughput dtype={args.dtype} concurrency={c} requests={n} "
                f"prompt={args.prompt_len} output={args.output_len} "
                f"max_num_batched_tokens={args.max_num_batched_tokens} | tierserve "
                f"{res['tok_s']:.1f} tok/s, step {res['step_ms']:.1f} ms, "
                f"ttft p50 {res['ttft_p50_ms']:.0f} ms, itl p50 {res['itl_p50_ms']:.1f} ms")
        if not args.no_hf and args.load_format != "dummy":
            hf = run_hf(engine.loaded.source, args.dtype, prompts, args.output_len, c)
            line += f" | transformers {hf:.1f} tok/s | ratio {res['tok_s'] / hf:.2f}x"
        print(line, flush=True)
