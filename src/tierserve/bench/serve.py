"""Streaming HTTP load against `tierserve serve`, beside the offline engine.

Starts `tierserve serve` on a free loopback port (or uses --url), then for each
concurrency c sends `requests` streaming /v1/completions requests, c at a time, closed
loop: 128-token prompts (token ids, seeded, no shared prefix), 128 output tokens, EOS
ignored, greedy. Prints one line per concurrency: output tok/s, TTFT and ITL p50/p99.
Then stops the server and runs the same prompts at --offline-concurrency through
LLMEngine in-process, and prints the HTTP/offline ratio.
"""

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

from tierserve.bench.throughput import make_prompts, run_engine


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="use a running server (loopback only)")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests", default=None,
                   help="comma-separated counts (default max(4, 2 x concurrency))")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bench-seed", type=int, default=4321)
    p.add_argument("--offline-concurrency", type=int, default=16,
                   help="concurrency of the in-process comparison (0 to skip)")


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def one_request(client, url, model, prompt, output_len, tier: str | None = None,
                      extra: dict | None = None):
    """One streamed completion: (tokens, TTFT, gaps between text chunks). `extra`: more
    body fields (vLLM's `priority`)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **({"service_tier": tier} if tier else {}), **(extra or {})}
    start = time.perf_counter()
    chunk_times, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {await resp.aread()}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
    ttft = chunk_times[0] - start if chunk_times else float("nan")
    return tokens, ttft, [b - a for a, b in zip(chunk_times, chunk_times[1:])]


async def run_level(url, model, prompts, output_len, concurrency):
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def bounded(p):
            async with sem:
                return await one_request(client, url, model, p, output_len)
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    ttfts = [r[1] for r in results]
    itls = [x for r in results for x in r[2]]
    return tokens / wall, ttfts, itls


def start_server(args, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`tierserve serve` on a free loopback port with args' engine flags (+ `extra`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(port),
           "--disable-uvicorn-access-log", "--served-model-name", "bench", "--dtype", args.dtype,
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import httpx
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready in 300 s")


def run(args) -> None:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    counts = ([int(n) for n in args.requests.split(",")] if args.requests
              else [max(4, 2 * c) for c in concurrencies])
    proc, url, model = None, args.url, "bench"
    if url:
        if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("error: load goes to loopback addresses only")
        import httpx
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    else:
        proc, url = start_server(args)
    vocab = 49152
    http_at = {}
    try:
        asyncio.run(run_level(url, model, make_prompts(2, args.prompt_len, vocab, 1), 8, 2))
        for c, n in zip(concurrencies, counts):
            prompts = make_prompts(n, args.prompt_len, vocab, args.bench_seed + c)
            tok_s, ttfts, itls = asyncio.run(run_level(url, model, prompts, args.output_len, c))
            http_at[c] = tok_s
            target = f"url={args.url}" if args.url else f"dtype={args.dtype}"
            print(f"serve {target} concurrency={c} requests={n} "
                  f"prompt={args.prompt_len} output={args.output_len} | http {tok_s:.1f} tok/s, "
                  f"ttft p50 {1000 * pct(ttfts, 50):.0f} ms p99 {1000 * pct(ttfts, 99):.0f} ms, "
                  f"itl p50 {1000 * pct(itls, 50):.1f} ms p99 {1000 * pct(itls, 99):.1f} ms",
                  flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    c = args.offline_concurrency
    if c and c in http_at and not args.url:
        from tierserve.engine.llm_engine import LLMEngine
        from tierserve.engine_args import engine_config_from_args
        engine = LLMEngine(engine_config_from_args(args))
        run_engine(engine, make_prompts(2, args.prompt_len, vocab, 1), 8, 2)
        prompts = make_prompts(counts[concurrencies.index(c)], args.prompt_len, vocab,
                               args.bench_seed + c)
        offline = run_engine(engine, prompts, args.output_len, c)["tok_s"]
        print(f"serve-vs-offline dtype={args.dtype} concurrency={c} | http {http_at[c]:.1f} "
              f"tok/s, offline {offline:.1f} tok/s | ratio {http_at[c] / offline:.2f}",
              flush=True)
