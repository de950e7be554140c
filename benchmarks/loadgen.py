#!/usr/bin/env python3
"""Fixed-workload async load client for OpenAI-compatible completion servers.

Sends N streaming POST /v1/completions requests at a fixed concurrency to a
server on loopback, and reports throughput and latency percentiles:

  output tok/s  = sum(completion tokens) / wall time of the whole run
  TTFT          = request start -> first non-empty text chunk
  ITL           = gap between consecutive content chunks, after the first
                  (a chunk that carries k>1 tokens is spread as k gaps)
  e2e           = request start -> end of stream

Prompts are deterministic (seeded choice from a fixed word list; each word is
one SmolLM2 token, plus 13 fixed tokens, so the default 115 words = 128
tokens). Each prompt starts with a distinct request index, so prompts share
at most a couple of leading tokens (prefix caching cannot help).

EOS is ignored where the server supports it (vLLM: ignore_eos + min_tokens);
for servers without ignore_eos (llama-cpp-python) pass --ban-tokens 0,2 to
send logit_bias -100 on SmolLM2's <|endoftext|>/<|im_end|> instead;
the completion-token count comes from the final `usage` block when the server
sends one (stream_options.include_usage), otherwise from counted text chunks.

Only loopback targets are allowed. Standard library + httpx only.

Example:
  python benchmarks/loadgen.py --url http://127.0.0.1:8000 --model smollm2 \
      --requests 64 --concurrency 16 --max-tokens 128 --out run.json
"""
import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from urllib.parse import urlparse

import httpx

WORDS = (
    "time person year way day thing man world life hand part child eye woman "
    "place work week case point government company number group problem fact "
    "river mountain garden window letter market engine signal forest harbor "
    "copper silver planet kitchen doctor teacher station bridge island valley "
    "winter summer morning evening history science music paper story table "
    "orange purple yellow simple quiet bright narrow gentle careful sudden"
).split()


def make_prompt(i, n_words, rng):
    body = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return f"Request {i}. Continue this list of words with a story: {body}"


def make_prompts(args):
    """Same args -> same prompts. Use a different --seed for each run against
    one live server, or its prefix cache will serve the repeated prompts."""
    rng = random.Random(args.seed)
    return [make_prompt(i, args.prompt_words, rng) for i in range(args.requests)]


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client, args, prompt):
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = args.max_tokens
    if args.ban_tokens:
        body["logit_bias"] = {t: -100 for t in args.ban_tokens.split(",")}
    rec = {"ok": False, "ttft": None, "itl": [], "e2e": None, "tokens": 0,
           "chunks": 0, "usage_tokens": None, "error": None}
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", args.url.rstrip("/") + "/v1/completions",
                                 json=body, timeout=args.timeout) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    rec["usage_tokens"] = msg["usage"].get("completion_tokens")
                choices = msg.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                rec["chunks"] += 1
                if last is None:
                    rec["ttft"] = now - t0
                else:
                    rec["itl"].append(now - last)
                last = now
        rec["e2e"] = time.perf_counter() - t0
        rec["tokens"] = rec["usage_tokens"] or rec["chunks"]
        # If one chunk carried several tokens, spread its gap evenly.
        if rec["usage_tokens"] and rec["chunks"] > 1 and rec["usage_tokens"] > rec["chunks"]:
            k = (rec["usage_tokens"] - 1) / (rec["chunks"] - 1)
            rec["itl"] = [g / k for g in rec["itl"] for _ in range(round(k))]
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 -- record and go on
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def run(args):
    prompts = make_prompts(args)
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as client:
        wrng = random.Random(-1 - args.seed)
        for i in range(args.warmup):  # not measured; prompts unlike the measured ones
            await one_request(client, args, make_prompt(f"W{i}", args.prompt_words, wrng))

        async def guarded(p):
            async with sem:
                return await one_request(client, args, p)

        t0 = time.perf_counter()
        recs = await asyncio.wait_for(asyncio.gather(*(guarded(p) for p in prompts)),
                                      timeout=args.deadline)
        wall = time.perf_counter() - t0
    ok = [r for r in recs if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [g for r in ok for g in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    toks = sum(r["tokens"] for r in ok)
    ms = lambda x: None if x is None else round(1000 * x, 2)  # noqa: E731
    res = {
        "label": args.label, "url": args.url, "model": args.model,
        "requests": args.requests, "ok": len(ok), "failed": len(recs) - len(ok),
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words, "seed": args.seed,
        "total_output_tokens": toks, "wall_s": round(wall, 3),
        "output_tok_s": round(toks / wall, 2) if wall > 0 else None,
        "mean_tokens_per_req": round(toks / len(ok), 1) if ok else None,
        "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p99": ms(pct(ttft, 99)),
        "itl_ms_p50": ms(pct(itl, 50)), "itl_ms_p99": ms(pct(itl, 99)),
        "e2e_ms_p50": ms(pct(e2e, 50)), "e2e_ms_p99": ms(pct(e2e, 99)),
        "itl_ms_mean": ms(statistics.fmean(itl)) if itl else None,
        # the longest stall any stream saw: p99 counts stalls, this says how long one was
        "itl_ms_max": ms(max(itl)) if itl else None,
        "errors": sorted({r["error"] for r in recs if r["error"]})[:5],
    }
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    ap.add_argument("--model", default="smollm2", help="model name sent in the request body")
    ap.add_argument("--requests", "-n", type=int, default=16, help="number of measured requests")
    ap.add_argument("--concurrency", "-c", type=int, default=1, help="requests in flight at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request")
    ap.add_argument("--prompt-words", type=int, default=115, help="random words per prompt (115 -> 128 SmolLM2 tokens)")
    ap.add_argument("--seed", type=int, default=1234, help="seed for prompt generation")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured sequential requests first")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="do not send ignore_eos/min_tokens")
    ap.add_argument("--ban-tokens", default="",
                    help="comma-separated token ids sent with logit_bias -100 (EOS ban)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    ap.add_argument("--deadline", type=float, default=1800.0, help="whole-run timeout, s")
    ap.add_argument("--label", default="", help="free text stored in the JSON")
    ap.add_argument("--out", help="append the JSON result as one line to this file")
    args = ap.parse_args()
    host = urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("loadgen: only loopback targets are allowed")
    res = asyncio.run(run(args))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
    print(json.dumps(res))
    print(f"SUMMARY {args.label} c={res['concurrency']} n={res['ok']}/{res['requests']} "
          f"tokens={res['total_output_tokens']} wall={res['wall_s']}s "
          f"out_tok_s={res['output_tok_s']} ttft_ms p50/p99={res['ttft_ms_p50']}/{res['ttft_ms_p99']} "
          f"itl_ms p50/p99={res['itl_ms_p50']}/{res['itl_ms_p99']} "
          f"e2e_ms p50/p99={res['e2e_ms_p50']}/{res['e2e_ms_p99']}")


if __name__ == "__main__":
    main()
