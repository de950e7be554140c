"""`tierserve serve` as a subprocess on loopback, and a client for it: whole and streamed
requests that record what the client saw (`Outcome`), batch jobs, /metrics, the server's
RSS, the ledger's rows. Shared by the soak and chaos benchmarks (bench/soak.py,
bench/chaos.py); the server runs with a YAML config of two tenants (`CONFIG`).
"""

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

MODEL = "bench"
KEYS = ("sk-soak-a", "sk-soak-b")
CONFIG = """api_keys:
  sk-soak-a: {tenant: team-a, tiers: [priority, default, flex]}
  sk-soak-b: {tenant: team-b}
"""
BATCH_AUTH = {"Authorization": "Bearer sk-soak-b"}  # team-a may not use the batch tier
TIERS = ("priority", "default", "flex")
FINAL = ("completed", "failed", "expired", "cancelled")


# ------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(args, port: int, ledger: str, data_dir: str, config: str) -> list[str]:
    """`tierserve serve` on loopback with the engine flags given to this benchmark. Without
    --step-time-profile, the default model on CPU uses the shipped profile (no 10 s
    calibration at every start)."""
    from dataclasses import fields

    from tierserve.engine_args import SECTIONS, explicit
    from tierserve.server.serve import DEFAULT_CPU_PROFILE

    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", MODEL, "--config", config, "--ledger", ledger,
           "--data-dir", data_dir]
    given = explicit(args)
    for _, cls in SECTIONS:
        for f in fields(cls):
            if f.name in given:
                flag, value = "--" + f.name.replace("_", "-"), getattr(args, f.name)
                if isinstance(value, bool):  # a switch given flips its default
                    cmd.append(flag if value else "--no-" + flag[2:])
                else:
                    cmd += [flag, str(value)]
    if "step_time_profile" not in given and args.model is None and args.device == "cpu":
        cmd += ["--step-time-profile", DEFAULT_CPU_PROFILE]
    return cmd + args.server_args.split()


def launch(cmd: list[str], log_path: str) -> subprocess.Popen:
    """Start the server, its output appended to `log_path`; does not wait."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during start-up (code {proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready in {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> bool:
    """SIGTERM (a clean shutdown), SIGKILL if it takes longer; whether it was clean."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def log_tail(path: str, lines: int = 15) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def rss_mb(pid: int) -> float | None:
    """The process's resident memory in MiB (None once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS:")),
                        None)
    except OSError:
        return None


async def scrape(http, url: str) -> dict[str, float]:
    """/metrics, each metric summed over its labels."""
    text = (await http.get(url + "/metrics")).text
    sums: dict[str, float] = Counter()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            sums[name.split("{")[0]] += float(value)
    return sums


# ----------------------------------------------------------------- requests
@dataclass
class Outcome:
    """What the client saw of one request (or of one batch line)."""

    kind: str  # whole, stream, abort (a stream the client drops), batch
    tier: str
    start: float  # time.monotonic()
    end: float = 0.0
    status: str = ""  # ok, aborted (we left), cut (connection lost), error, http-<code>
    id: str | None = None
    ttft: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def make_body(rng: random.Random, tier: str | None, stream: bool, max_tokens: int,
              chat: bool | None = None) -> dict:
    words = " ".join(str(rng.randrange(1000)) for _ in range(rng.randrange(4, 40)))
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.7,
            "seed": rng.randrange(1 << 30), "ignore_eos": True}
    if tier is not None:
        body["service_tier"] = tier
    if chat if chat is not None else rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": f"Continue: {words}"}]
    else:
        body["prompt"] = f"Numbers: {words}"
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def send(http, url: str, key: str, body: dict, kind: str,
               abort_after: int | None = None, first_text=None) -> Outcome:
    """One request; a stream is dropped after `abort_after` chunks of text if given, and
    sets `first_text` (an asyncio.Event) at its first."""
    import httpx

    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    out = Outcome(kind, body.get("service_tier", "default"), time.monotonic())
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if not body.get("stream"):
            r = await http.post(url + path, json=body, headers=headers)
            out.id, out.status = r.headers.get("x-request-id"), f"http-{r.status_code}"
            if r.status_code == 200:
                data = r.json()
                out.status, out.id, usage = "ok", data["id"], data["usage"]
                out.prompt_tokens, out.completion_tokens = (usage["prompt_tokens"],
                                                            usage["completion_tokens"])
        else:
            async with http.stream("POST", url + path, json=body, headers=headers) as r:
                out.id = r.headers.get("x-request-id")
                if r.status_code != 200:
                    await r.aread()
                    out.status = f"http-{r.status_code}"
                else:
                    await _read_stream(r, out, abort_after, first_text)
    except httpx.HTTPError:
        out.status = out.status or "cut"
    out.end = time.monotonic()
    return out


async def _read_stream(r, out: Outcome, abort_after: int | None, first_text) -> None:
    chunks = 0
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out.status = "ok"
            return
        event = json.loads(line[6:])
        if "error" in event:
            out.status = "error"
            return
        out.id = event.get("id", out.id)
        if usage := event.get("usage"):
            out.prompt_tokens, out.completion_tokens = (usage["prompt_tokens"],
                                                        usage["completion_tokens"])
        choice = (event.get("choices") or [{}])[0]
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            chunks += 1
            if out.ttft is None:
                out.ttft = time.monotonic() - out.start
                if first_text is not None:
                    first_text.set()
            if abort_after is not None and chunks >= abort_after:
                out.status = "aborted"
                return
    out.status = "cut"  # the body ended without [DONE]


async def submit_batch(http, url: str, bodies: list[dict], tag: str) -> str:
    """Upload `bodies` as a /v1/completions batch (custom ids `tag-i`); the batch id."""
    data = "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST",
                               "url": "/v1/completions", "body": b}) + "\n"
                   for i, b in enumerate(bodies))
    r = await http.post(url + "/v1/files", headers=BATCH_AUTH, data={"purpose": "batch"},
                        files={"file": (f"{tag}.jsonl", data.encode())})
    r.raise_for_status()
    r = await http.post(url + "/v1/batches", headers=BATCH_AUTH, json={
        "input_file_id": r.json()["id"], "endpoint": "/v1/completions",
        "completion_window": "24h"})
    r.raise_for_status()
    return r.json()["id"]


async def batch_status(http, url: str, batch_id: str) -> dict:
    r = await http.get(f"{url}/v1/batches/{batch_id}", headers=BATCH_AUTH)
    r.raise_for_status()
    return r.json()


async def batch_outcomes(http, url: str, batch: dict) -> list[Outcome]:
    """One Outcome per line of a finished batch's output and error files."""
    out = []
    for fid in (batch["output_file_id"], batch["error_file_id"]):
        if fid is None:
            continue
        r = await http.get(f"{url}/v1/files/{fid}/content", headers=BATCH_AUTH)
        for line in r.text.splitlines():
            resp = json.loads(line).get("response") or {}
            body = resp.get("body") or {}
            usage, end = body.get("usage") or {}, time.monotonic()
            out.append(Outcome("batch", "batch", end, end,
                               "ok" if resp.get("status_code") == 200 else "error",
                               body.get("id") or resp.get("request_id"), None,
                               usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)))
    return out


# ------------------------------------------------------------------ the ledger
def ledger_rows(path: str) -> list[tuple]:
    """(request_id, prompt_tokens, output_tokens, finish_reason, charge, tags) per row."""
    con = sqlite3.connect(path, timeout=30)
    try:
        return con.execute("SELECT request_id, prompt_tokens, output_tokens, finish_reason, "
                           "charge, tags FROM requests").fetchall()
    finally:
        con.close()
