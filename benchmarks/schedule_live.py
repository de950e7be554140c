"""A live server following a compressed capacity schedule (seconds for hours) under load:
does each entry's setting reach the engine, do batch lines wait for the batch entry, is
any request lost.

    python benchmarks/schedule_live.py [--hour-s 30] [--cycles 2] [--concurrency 3]

`tierserve serve` on loopback with a 4-entry schedule (reserves, caps and batch windows
changing); clients send priority and default requests all along and submit a batch job
in a closed entry. Prints one line with its config and the figures.
"""

import argparse
import io
import json
import math
import os
import sys
import tempfile
import threading
import time

import httpx
import yaml

from tierserve.bench import loopback

ENTRIES = [  # max_num_seqs, reserved_priority_seqs, priority_step_time_s, batch, replicas
    (32, 4, None, False, 3), (16, 2, 0.2, False, 2), (32, 0, None, True, 1),
    (8, 1, 0.1, True, 1)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hour-s", type=float, default=30.0)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=3)
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="schedule-")
    start = time.time() + 60  # the model loads first
    hours = [{"hour": i, "replicas": {"main": r}, "need": {"main": r}, "max_num_seqs": s,
              "max_num_batched_tokens": 512, "reserved_priority_seqs": res,
              "priority_step_time_s": cap, "batch": batch}
             for i, (s, res, cap, batch, r) in enumerate(ENTRIES)]
    cfg = os.path.join(tmp, "c.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump({"schedule": {"start": start, "hour_s": args.hour_s, "hours": hours}}, f)
    port = loopback.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = loopback.launch([sys.executable, "-m", "tierserve.cli", "serve", "--port",
                            str(port), "--config", cfg, "--ledger", os.path.join(tmp, "l.db"),
                            "--data-dir", os.path.join(tmp, "d"), "--max-num-seqs", "32",
                            "--disable-uvicorn-access-log", "--step-time-profile", profile()],
                           os.path.join(tmp, "log"))
    statuses, seen, stop = [], {}, threading.Event()
    try:
        loopback.wait_ready(proc, url)
        cycle = len(ENTRIES) * args.hour_s  # begin at an entry 0 (the schedule repeats)
        start += max(0, math.ceil((time.time() - start) / cycle)) * cycle
        while time.time() < start:
            time.sleep(0.2)

        def load(k):
            n = 0
            while not stop.is_set():
                r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                    "model": "SmolLM2-135M-Instruct", "max_tokens": 16,
                    "service_tier": ("priority", "default")[(n + k) % 2],
                    "messages": [{"role": "user", "content": f"Say {n} in words."}]})
                statuses.append(r.status_code)
                n += 1

        threads = [threading.Thread(target=load, args=(k,)) for k in range(args.concurrency)]
        for t in threads:
            t.start()
        batch_id, submitted_in, first_line_at = None, None, None
        end = start + args.cycles * len(ENTRIES) * args.hour_s
        while time.time() < end:
            s = httpx.get(url + "/v1/schedule").json()
            seen.setdefault(s["entry"], set()).add(json.dumps(s["applied"], sort_keys=True))
            if batch_id is None and s["entry"] == 0:
                body = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST",
                                           "url": "/v1/chat/completions", "body": {
                                               "model": "SmolLM2-135M-Instruct",
                                               "max_tokens": 8, "messages": [
                                                   {"role": "user", "content": "Hi"}]}})
                               + "\n" for i in range(8))
                fid = httpx.post(url + "/v1/files", files={"file": ("b.jsonl", io.BytesIO(
                    body.encode()))}, data={"purpose": "batch"}).json()["id"]
                batch_id = httpx.post(url + "/v1/batches", json={
                    "input_file_id": fid, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"}).json()["id"]
                submitted_in = s["entry"]
            if batch_id and first_line_at is None:
                b = httpx.get(url + f"/v1/batches/{batch_id}").json()
                if b["request_counts"]["completed"]:
                    first_line_at = s["entry"]
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        final = httpx.get(url + f"/v1/batches/{batch_id}").json() if batch_id else {}
    finally:
        stop.set()
        loopback.stop(proc)
    matched = 0
    for i, (s, res, cap, _, _) in enumerate(ENTRIES):
        applied = [json.loads(x) for x in seen.get(i, ())]
        matched += any(a.get("max_num_seqs") == s and a.get("reserved_priority_seqs") == res
                       and (cap is None or a.get("priority_step_time_s") == cap)
                       for a in applied)
    lost = sum(st != 200 for st in statuses)
    print(f"schedule_live hour_s={args.hour_s} cycles={args.cycles} entries={len(ENTRIES)} "
          f"concurrency={args.concurrency}: entries applied as planned {matched}/"
          f"{len(ENTRIES)}; requests {len(statuses)}, not 200: {lost}; batch submitted in "
          f"entry {submitted_in} (closed), first line done in entry {first_line_at} "
          f"(batch entries: 2, 3), batch {final.get('status')} "
          f"{final.get('request_counts')}")
    return 0 if lost == 0 and matched == len(ENTRIES) else 1


def profile() -> str:
    from tierserve.server.serve import DEFAULT_CPU_PROFILE
    return DEFAULT_CPU_PROFILE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
