"""The hybrid plan at fleet scale: one gateway (`tierserve serve --backend`) in front of a
small pool (a tierserve replica with SmolLM2-135M) and a large pool (a tierserve replica
with a Llama-3.2-1B shape on dummy weights, a stand-in for a large model's cost and
latency only, labelled so), each replica on one core at the same price per hour. The
seeded customer-service workload of bench/hybrid.py, in the same open-loop arrival times,
is served five ways:

  (a) everything on the large model in the priority tier (the dedicated fast lane: the
      "before" of the story);
  (b) everything on the large model in the default tier (shared, batched);
  (c) `routes:` rules across the two pools;
  (d) the learned router (`score_min` on the trained classifier);
  (e) a shuffled control: each request sent to the large pool (default tier) at random
      with (d)'s share, else to the small one in the priority tier.

Cost per 1K conversations is the gateway ledger's (each replica's machine time split
among its requests; a tierserve replica reports its exact figure); simple-turn TTFT as
the client saw it; routing accuracy against the workload's labels, from where the ledger
says each request ran. Every phase starts fresh replicas and a fresh gateway (no prefix
cache carried over).
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
from tierserve.bench.hybrid import LARGE, LEARNED, RULES, send
from tierserve.core.stats import percentile
from tierserve.route.conversations import workload

PRICE = 3.6
"""USD per hour of each replica's core (both pools alike)."""
SLO = {"priority": (3.0, 0.3), "default": (5.0, 0.5)}
"""(TTFT s, TPOT s) per tier: what one core can hold for the 1B stand-in at this load
(the plan is asked for the same)."""


def replica_cmd(port: int, name: str, args) -> list[str]:
    from tierserve.model.metadata import default_model_path

    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", name, "--no-ledger", "--no-batches",
           "--machine-price-per-hour", str(PRICE), "--kv-cache-memory-gb", "1"]
    if name == "small":  # calibrated on one thread, as it runs (cached after the first)
        return cmd + ["--max-num-seqs", "16", "--quantization", args.small_quantization]
    return cmd + [LARGE, "--load-format", "dummy", "--dtype", "bfloat16", "--quantization",
                  "none", "--tokenizer", str(default_model_path()),
                  "--max-num-seqs", str(args.large_max_num_seqs)]


def gateway_config(small: str, large: str, classifier: str) -> str:
    import yaml

    from tierserve.model.metadata import default_model_path

    return yaml.safe_dump({
        "backends": [small, large],
        "pools": {"large": {"tokenizer": str(default_model_path())}},
        "routes": {"hybrid-rules": RULES, "hybrid-learned": LEARNED},
        "route_classifier": classifier}, sort_keys=False)


def rows_of(ledger: str, phase: str) -> list[dict]:
    con = sqlite3.connect(ledger, timeout=30)
    rows = con.execute("SELECT model, tier_served, prefill_cost, decode_cost, tags, "
                       "mean_batch_size, queue_s, prefill_s, decode_s, output_tokens "
                       "FROM requests").fetchall()
    con.close()
    out = []
    for model, tier, prefill, decode, tags, batch, queue_s, prefill_s, decode_s, n in rows:
        t = json.loads(tags or "{}")
        if t.get("phase") == phase:
            out.append({"model": model, "tier": tier, "prefill": prefill, "decode": decode,
                        "label": t.get("label"), "mean_batch": batch,
                        "ttft_s": (queue_s or 0) + (prefill_s or 0),
                        "tpot_s": (decode_s or 0) / max(n - 1, 1)})
    return out


def attainment(rows: list[dict]) -> float | None:
    """Share of requests within their served tier's SLO (SLO: TTFT and TPOT)."""
    met = [r["ttft_s"] <= SLO[r["tier"]][0] and r["tpot_s"] <= SLO[r["tier"]][1]
           for r in rows if r["tier"] in SLO]
    return sum(met) / len(met) if met else None


def summarize(phase: str, results: list[dict], rows: list[dict], n: int) -> dict:
    simple = [r["ttft_s"] for r in results if r["body"]["metadata"]["label"] == "simple"]
    cost = sum(r["prefill"] + r["decode"] for r in rows)
    by_pool = {m: sum(r["prefill"] + r["decode"] for r in rows if r["model"] == m)
               for m in ("small", "large")}
    right = sum((r["model"] == "large") == (r["label"] == "hard") for r in rows)
    large = [r["mean_batch"] for r in rows if r["model"] == "large" and r["mean_batch"]]
    return {"phase": phase, "requests": len(results), "billed_rows": len(rows),
            "errors": sum(r["status"] != 200 for r in results),
            "cost_per_1k_conversations_usd": 1000 * cost / n,
            "cost_by_pool_usd": by_pool,
            "prefill_share": sum(r["prefill"] for r in rows) / cost if cost else None,
            "to_large": sum(r["model"] == "large" for r in rows),
            "simple_ttft_p50_s": percentile(simple, 0.5),
            "simple_ttft_p99_s": percentile(simple, 0.99),
            "routing_accuracy": right / len(rows) if rows else None,
            "slo_attainment": attainment(rows),
            "large_mean_batch": sum(large) / len(large) if large else None}


def run_phase(phase: str, choose, requests, tmp: str, classifier: str, args) -> dict:
    ports = {n: loopback.free_port() for n in ("small", "large", "gateway")}
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core per replica
    procs = []
    try:
        for name in ("small", "large"):
            with open(os.path.join(tmp, f"{phase}-{name}.log"), "ab") as log:
                import subprocess
                procs.append(subprocess.Popen(replica_cmd(ports[name], name, args), env=env,
                                              stdout=log, stderr=subprocess.STDOUT))
        for proc, name in zip(procs, ("small", "large")):
            loopback.wait_ready(proc, urls[name], timeout_s=600)
        cfg = os.path.join(tmp, f"{phase}-gateway.yaml")
        with open(cfg, "w") as f:
            f.write(gateway_config(urls["small"], urls["large"], classifier))
        ledger = os.path.join(tmp, f"{phase}-ledger.db")
        gw = loopback.launch([sys.executable, "-m", "tierserve.cli", "serve", "--host",
                              "127.0.0.1", "--port", str(ports["gateway"]), "--config", cfg,
                              "--ledger", ledger, "--no-batches",
                              "--machine-price-per-hour", str(PRICE)],
                             os.path.join(tmp, f"{phase}-gateway.log"))
        procs.append(gw)
        loopback.wait_ready(gw, urls["gateway"], timeout_s=120)
        results = asyncio.run(send(urls["gateway"], requests, choose, phase, args.rate,
                                   args.seed, args.max_tokens))
        time.sleep(1.5)  # the ledger's writer
        return summarize(phase, results, rows_of(ledger, phase), args.conversations)
    finally:
        for proc in reversed(procs):
            loopback.stop(proc)


def workload_span_s(args) -> float:
    """The last arrival's time, as `send` spaces them."""
    rng, at = random.Random(args.seed), 0.0
    for _ in range(args.conversations - 1):
        at += rng.expovariate(args.rate)
    return at


def plan_lines(tmp: str, args) -> list[str]:
    """`tierserve plan --hybrid` for the same workload on the replicas' own calibrations
    (read from the last phase's logs)."""
    import re
    import subprocess

    paths = {}
    for name in ("small", "large"):
        with open(os.path.join(tmp, f"e-{name}.log")) as f:
            found = re.findall(r"step-time model from (\S+\.json)", f.read())
        if not found:
            return [f"no calibration of the {name} replica found in its log"]
        paths[name] = found[-1]
    cmd = [sys.executable, "-m", "tierserve.cli", "plan", "--model", LARGE, "--hybrid",
           "smollm2-135m", "--hybrid-profiles", f"{paths['small']},{paths['large']}",
           "--hybrid-price-per-hour", str(PRICE),
           "--slo", "priority=%g,%g" % SLO["priority"], "--slo", "default=%g,%g" % SLO["default"],
           "--hybrid-requests", str(args.conversations), "--hybrid-rate", str(args.rate),
           "--hybrid-output-tokens", str(args.max_tokens), "--seed", str(args.seed),
           "--max-num-seqs", str(args.large_max_num_seqs), "--max-replicas", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return [" ".join(cmd[2:])] + (r.stdout.strip().splitlines() or
                                  [r.stderr.strip().splitlines()[-1]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.4, help="arrivals per second")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--large-max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--small-quantization", default="none")
    args = p.parse_args(argv)
    from tierserve.route.classifier import train

    tmp = tempfile.mkdtemp(prefix="hybrid-fleet-")
    train_path = os.path.join(tmp, "train.jsonl")
    with open(train_path, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in workload(600, seed=1))
    trained = train(train_path, os.path.join(tmp, "router.joblib"))
    requests = workload(args.conversations, seed=args.seed)
    fixed = {"a": lambda i: ("large", "priority"), "b": lambda i: ("large", "default"),
             "c": lambda i: ("hybrid-rules", None), "d": lambda i: ("hybrid-learned", None)}
    figures = {}
    for phase, choose in fixed.items():
        figures[phase] = run_phase(phase, choose, requests, tmp, trained["out"], args)
        print(json.dumps(figures[phase]), flush=True)
    share = figures["d"]["to_large"] / max(figures["d"]["billed_rows"], 1)
    coin = random.Random(args.seed + 1)
    draws = [coin.random() < share for _ in requests]
    figures["e"] = run_phase("e", lambda i: ("large", "default") if draws[i] else
                             ("small", "priority"), requests, tmp, trained["out"], args)
    print(json.dumps(figures["e"]), flush=True)
    plan = plan_lines(tmp, args)
    for line in plan:
        print(f"plan: {line}", flush=True)
    span_h = workload_span_s(args) / 3600
    machines = {k: (1 if k in ("a", "b") else 2) for k in figures}
    hours = " ".join(f"{k}={1000 * machines[k] * PRICE * span_h / args.conversations:.4f}"
                     for k in figures)
    print(f"measured fleets: a, b 1 replica (large); c, d, e 1 + 1; replica-hours over the "
          f"arrivals per 1K conversations {hours} USD; SLO attainment "
          + " ".join(f"{k}={f['slo_attainment']:.2f}" for k, f in figures.items()),
          flush=True)
    a = figures["a"]["cost_per_1k_conversations_usd"]
    parts = " ".join(
        f"{k}={f['cost_per_1k_conversations_usd']:.4f}({f['cost_per_1k_conversations_usd'] / a - 1:+.0%})"
        for k, f in figures.items())
    ttft = " ".join(f"{k}={f['simple_ttft_p50_s']:.3f}/{f['simple_ttft_p99_s']:.3f}"
                    for k, f in figures.items())
    acc = " ".join(f"{k}={f['routing_accuracy']:.3f}" for k, f in figures.items())
    print(f"hybrid_fleet conversations={args.conversations} rate={args.rate}/s "
          f"max_tokens={args.max_tokens} small=SmolLM2-135M({args.small_quantization}) "
          f"large={LARGE}(dummy weights, stand-in) 1 core/replica ${PRICE}/h each "
          f"classifier_cv_acc={trained['cv_accuracy']:.3f} shuffled_share_large={share:.2f}: "
          f"cost/1K conv (vs a) {parts} USD; simple TTFT p50/p99 s {ttft}; routing accuracy "
          f"{acc}; errors {sum(f['errors'] for f in figures.values())}")
    return 0
