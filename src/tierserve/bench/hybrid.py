"""Hybrid serving: the seeded customer-service workload (route/conversations.py) served
(a) entirely by the large model in the priority tier, (b) hybrid by rules, (c) hybrid by
the trained classifier; cost per 1,000 conversations from the ledger, TTFT p50/p99 of
the simple turns, and routing accuracy against the labels.

One `tierserve serve` on loopback serves both models and the two aliases, started afresh
for each run (so no run finds another's prompts in the prefix cache); the three runs send
the same requests, in the same open-loop arrival times, one after the other.

The small model is SmolLM2-135M-Instruct. The large one is a Llama-3.2-1B shape with
dummy (random) weights, labelled so: it stands in for a large model's cost and latency
only (issue 17 allows this); its answers are noise, which is why the cascade is not
measured here (its check would judge noise).
"""

import argparse
import asyncio
import json
import os
import random
import sqlite3
import sys
import tempfile
import time

from tierserve.bench import loopback
from tierserve.core.stats import percentile
from tierserve.route.conversations import workload

LARGE = "llama-3.2-1b"

RULES = [  # what an operator would write from the story: greetings and one-line questions
    # go to the small model at once; anything long, multi-turn or about money and faults
    # to the large one, batched
    {"name": "long-or-multi-turn", "when": {"turns_min": 2}, "model": "large",
     "tier": "default"},
    {"name": "trouble", "when": {"regex": "(?i)broke|stopp|charged|refund|summari|invoice|"
                                          "warranty|damaged|compare|not working|error"},
     "model": "large", "tier": "default"},
    {"name": "long", "when": {"prompt_tokens_min": 90}, "model": "large", "tier": "default"},
    {"name": "simple", "model": "small", "tier": "priority"},
]
LEARNED = [{"name": "hard", "when": {"score_min": 0.5}, "model": "large", "tier": "default"},
           {"name": "simple", "model": "small", "tier": "priority"}]


def config(classifier: str, args) -> str:
    import yaml

    from tierserve.model.metadata import default_model_path

    return yaml.safe_dump({
        "models": {"large": {"model": LARGE, "load_format": "dummy", "dtype": "bfloat16",
                             "quantization": "none",  # the small model's may not suit it
                             "max_num_seqs": args.large_max_num_seqs,
                             # the small model's tokenizer: prompts in, (noise) text out
                             "tokenizer": default_model_path(),
                             "step_time_profile": None}},  # its own, calibrated at start
        "routes": {"hybrid-rules": RULES, "hybrid-learned": LEARNED},
        "route_classifier": classifier}, sort_keys=False)


async def one(http, url: str, body: dict, at: float, start: float, out: list) -> None:
    await asyncio.sleep(max(0.0, start + at - time.monotonic()))
    sent = time.monotonic()
    ttft, route = None, None
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        route = r.headers.get("x-tierserve-route")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):  # sent with the first token
                ttft = time.monotonic() - sent
        status = r.status_code
    out.append({"status": status, "ttft_s": ttft, "route": route, "body": body})


async def run_phase(url: str, requests: list[dict], model: str, tier: str | None,
                    phase: str, rate: float, seed: int, max_tokens: int) -> list[dict]:
    return await send(url, requests, lambda i: (model, tier), phase, rate, seed, max_tokens)


async def send(url: str, requests: list[dict], choose, phase: str, rate: float, seed: int,
               max_tokens: int) -> list[dict]:
    """The requests, streamed open loop at `rate` (Poisson, seeded); `choose(i)`: the
    (model, tier or None) of request i."""
    import httpx

    rng = random.Random(seed)
    at, out, tasks = 0.0, [], []
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as http:
        for i, req in enumerate(requests):
            model, tier = choose(i)
            body = {"model": model, "messages": req["messages"], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True,
                    "metadata": {"phase": phase, "label": req["label"], "i": str(i)}}
            if tier:
                body["service_tier"] = tier
            tasks.append(asyncio.create_task(one(http, url, body, at, start, out)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return out


def ledger_by_phase(path: str) -> dict[str, list[dict]]:
    con = sqlite3.connect(path, timeout=30)
    rows = con.execute("SELECT model, tier_served, prefill_cost + decode_cost, tags, "
                       "output_tokens, mean_batch_size FROM requests").fetchall()
    con.close()
    out: dict[str, list] = {}
    for model, tier, cost, tags, out_tokens, batch in rows:
        t = json.loads(tags or "{}")
        out.setdefault(t.get("phase"), []).append({"model": model, "tier": tier, "cost": cost,
                                                  "label": t.get("label"),
                                                  "output_tokens": out_tokens,
                                                  "mean_batch": batch})
    return out


def summarize(phase: str, results: list[dict], rows: list[dict], n: int) -> dict:
    simple = [r["ttft_s"] for r in results if r["body"]["metadata"]["label"] == "simple"]
    routed = [r for r in results if r["route"]]
    right = sum(("model=large" in r["route"]) == (r["body"]["metadata"]["label"] == "hard")
                for r in routed)
    cost = sum(r["cost"] for r in rows)
    simple_cost = sum(r["cost"] for r in rows if r["label"] == "simple")
    return {"phase": phase, "requests": len(results),
            "hard": sum(r["body"]["metadata"]["label"] == "hard" for r in results),
            "simple_cost_share": simple_cost / cost if cost else None,
            "errors": sum(r["status"] != 200 for r in results),
            "cost_per_1k_conversations_usd": 1000 * cost / n,
            "simple_ttft_p50_s": percentile(simple, 0.5),
            "simple_ttft_p99_s": percentile(simple, 0.99),
            "routing_accuracy": right / len(routed) if routed else None,
            "to_large": sum(r["model"] == "large" for r in rows),
            "large_mean_batch": _mean([r["mean_batch"] for r in rows if r["model"] == "large"]),
            "large_cost_share": sum(r["cost"] for r in rows if r["model"] == "large") / cost
            if cost else None}


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.4, help="arrivals per second")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--large-max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--small-quantization", default="none",
                   help="the small model's --quantization (gguf: its file's 4-bit weights)")
    args = p.parse_args(argv)
    from tierserve.route.classifier import train

    tmp = tempfile.mkdtemp(prefix="hybrid-")
    train_path = os.path.join(tmp, "train.jsonl")
    with open(train_path, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in workload(600, seed=1))
    trained = train(train_path, os.path.join(tmp, "router.joblib"))
    cfg = os.path.join(tmp, "hybrid.yaml")
    with open(cfg, "w") as f:
        f.write(config(trained["out"], args))
    requests = workload(args.conversations, seed=args.seed)
    port, ledger = loopback.free_port(), os.path.join(tmp, "ledger.db")
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "small", "--config", cfg,
           "--ledger", ledger, "--quantization", args.small_quantization]
    phases = [("a", "large", "priority"), ("b", "hybrid-rules", None),
              ("c", "hybrid-learned", None)]
    results = {}
    for phase, model, tier in phases:
        # A fresh server per run: the same prompts would otherwise find the previous
        # run's prefixes cached, and the later runs would pay almost no prefill.
        proc = loopback.launch(cmd, os.path.join(tmp, f"server-{phase}.log"))
        try:
            loopback.wait_ready(proc, url, timeout_s=600)
            results[phase] = asyncio.run(run_phase(url, requests, model, tier, phase,
                                                   args.rate, args.seed, args.max_tokens))
        finally:
            loopback.stop(proc)
    rows = ledger_by_phase(ledger)
    figures = [summarize(ph, results[ph], rows.get(ph, []), args.conversations)
               for ph, _, _ in phases]
    for f in figures:
        print(json.dumps(f))
    a, b, c = figures
    print(f"hybrid conversations={args.conversations} (hard {a['hard']}) rate={args.rate}/s "
          f"max_tokens={args.max_tokens} small=SmolLM2-135M({args.small_quantization}) "
          f"large={LARGE}(dummy weights, stand-in) "
          f"classifier_cv_acc={trained['cv_accuracy']:.3f}: cost/1K conv a={a['cost_per_1k_conversations_usd']:.4f} "
          f"b={b['cost_per_1k_conversations_usd']:.4f} c={c['cost_per_1k_conversations_usd']:.4f} USD "
          f"(b {1 - b['cost_per_1k_conversations_usd'] / a['cost_per_1k_conversations_usd']:.0%} "
          f"cheaper, c {1 - c['cost_per_1k_conversations_usd'] / a['cost_per_1k_conversations_usd']:.0%}); "
          f"simple TTFT p50/p99 a={a['simple_ttft_p50_s']:.3f}/{a['simple_ttft_p99_s']:.3f} "
          f"b={b['simple_ttft_p50_s']:.3f}/{b['simple_ttft_p99_s']:.3f} "
          f"c={c['simple_ttft_p50_s']:.3f}/{c['simple_ttft_p99_s']:.3f} s; routing accuracy "
          f"b={b['routing_accuracy']:.3f} c={c['routing_accuracy']:.3f}; errors "
          f"{a['errors'] + b['errors'] + c['errors']}; simple turns' share of a's cost "
          f"{a['simple_cost_share']:.0%} (the most routing them can save); large model's "
          f"mean batch a={a['large_mean_batch']:.1f} b={b['large_mean_batch']:.1f} "
          f"c={c['large_mean_batch']:.1f}")
    return 0
