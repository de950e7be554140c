"""Batch jobs: throughput in idle capacity, and what a running batch does to priority TTFT.

Starts `tierserve serve` (data dir and ledger in a temporary folder), then:
1. batch throughput: a batch of `--lines` completions (token-id prompts, EOS ignored,
   greedy), output tokens / wall time from creation to `completed` (polled every 0.1 s);
2. priority TTFT alone: `--priority-requests` streaming priority requests, one at a time;
3. priority TTFT during a batch: the same priority requests while a second batch of other
   prompts runs (only those that ended while it was still in progress count).
Each batch starts after `--settle-s` of quiet, so no priority traffic keeps the tiered
step cap on (the cap stays on `--priority-guard-s` after priority traffic).
Then stops the server and runs the same prompts through LLMEngine in-process at
concurrency `--max-num-seqs` (the offline figure), and prints the ratio.
"""

import argparse
import asyncio
import io
import json
import tempfile
import time

from tierserve.bench.serve import one_request, pct, start_server
from tierserve.bench.throughput import make_prompts, run_engine


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, default=96, help="requests per batch")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--priority-requests", type=int, default=40)
    p.add_argument("--priority-output-len", type=int, default=16)
    p.add_argument("--bench-seed", type=int, default=4321)
    p.add_argument("--server-args", default="",
                   help="more `tierserve serve` flags, one string (\"--priority-guard-s 600\")")
    p.add_argument("--settle-s", type=float, default=12.0,
                   help="quiet time before the throughput batch and before the loaded "
                        "phase (longer than --priority-guard-s, 10 s)")


def batch_file(prompts, output_len: int) -> bytes:
    return "".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": "bench", "prompt": p, "max_tokens": output_len, "temperature": 0,
                 "ignore_eos": True}}) + "\n" for i, p in enumerate(prompts)).encode()


def submit(client, data: bytes):
    f = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h")


def priority_ttfts(url: str, prompts, output_len: int, while_batch=None) -> list[float]:
    """TTFT of each prompt sent alone, in turn, as a priority request; with `while_batch`
    (client, batch id), only those that ended while the batch was still in progress."""
    import httpx

    async def run():
        out = []
        async with httpx.AsyncClient(timeout=600) as http:
            for p in prompts:
                _, ttft, _ = await one_request(http, url, "bench", p, output_len,
                                               tier="priority")
                if while_batch is not None:
                    client, bid = while_batch
                    if client.batches.retrieve(bid).status != "in_progress":
                        break
                out.append(ttft)
                await asyncio.sleep(0.2)
        return out
    return asyncio.run(run())


def run(args) -> None:
    import openai

    vocab = 49152
    prompts = make_prompts(args.lines, args.prompt_len, vocab, args.bench_seed)
    fast = make_prompts(args.priority_requests, 32, vocab, args.bench_seed + 1)
    data = batch_file(prompts, args.output_len)
    config = (f"lines={args.lines} prompt={args.prompt_len} output={args.output_len} "
              f"max_num_seqs={args.max_num_seqs} dtype={args.dtype} "
              f"priority: n={args.priority_requests} prompt=32 output={args.priority_output_len}"
              + (f" server_args='{args.server_args}'" if args.server_args else ""))
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(args, ["--data-dir", f"{tmp}/data", "--ledger",
                                        f"{tmp}/ledger.db", *args.server_args.split()])
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            priority_ttfts(url, fast[:2], 4)  # warm up
            time.sleep(args.settle_s)  # past --priority-guard-s: the step cap is off
            start = time.perf_counter()
            batch = submit(client, data)
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(0.1)
                batch = client.batches.retrieve(batch.id)
            wall = time.perf_counter() - start
            assert batch.status == "completed", batch
            tokens = batch.model_dump()["usage"]["output_tokens"]
            idle = priority_ttfts(url, fast, args.priority_output_len)
            time.sleep(args.settle_s)  # the first priority request finds a full-size step
            other = make_prompts(2 * args.lines, args.prompt_len, vocab, args.bench_seed + 2)
            busy = submit(client, batch_file(other, args.output_len))  # no cached prefixes
            while client.batches.retrieve(busy.id).request_counts.completed < 1:
                time.sleep(0.1)
            loaded = priority_ttfts(url, fast, args.priority_output_len, (client, busy.id))
            if client.batches.retrieve(busy.id).status == "in_progress":
                client.batches.cancel(busy.id)  # enough measured: stop it
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.engine_args import engine_config_from_args
    engine = LLMEngine(engine_config_from_args(args))
    run_engine(engine, make_prompts(2, args.prompt_len, vocab, 1), 8, 2)
    offline = run_engine(engine, prompts, args.output_len, args.max_num_seqs)["tok_s"]
    batch_tok_s = tokens / wall
    qs = (50, 90, 99)
    a, b = [pct(idle, q) for q in qs], [pct(loaded, q) for q in qs]
    print(f"batch {config} | batch {batch_tok_s:.1f} tok/s ({tokens} tokens in {wall:.1f} s), "
          f"offline {offline:.1f} tok/s, ratio {batch_tok_s / offline:.2f} | priority ttft "
          f"p50/p90/p99 idle {'/'.join(f'{1000 * x:.0f}' for x in a)} ms, during batch "
          f"{'/'.join(f'{1000 * x:.0f}' for x in b)} ms (n={len(loaded)}, first "
          f"{1000 * loaded[0]:.0f} ms), ratio {'/'.join(f'{y / x:.2f}' for x, y in zip(a, b))}",
          flush=True)
