"""Fleet tests' parts: real tierserve replicas in subprocesses, and a gateway (the real
server app in fleet mode) on a loopback port in a thread."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tierserve.core.step_time import StepTimeModel
from tierserve.router.flow import FlowConfig
from tierserve.router.remote import ReplicaSpec
from tierserve.server.serve import DEFAULT_CPU_PROFILE

MODEL = "SmolLM2-135M-Instruct"
PRICE = 3.6
"""USD per hour of every replica, on both sides (so estimate and exact compare)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TierserveReplica:
    """`tierserve serve` in its own process (one torch thread: two share the two cores)."""

    def __init__(self, log_dir: Path, name: str, *args: str, threads: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.log = open(log_dir / f"{name}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(self.port),
             "--no-ledger", "--no-batches", "--step-time-profile", DEFAULT_CPU_PROFILE,
             "--max-num-seqs", "16", "--machine-price-per-hour", str(PRICE),
             "--kv-cache-memory-gb", "0.25", *args],
            env=env, stdout=self.log, stderr=self.log, start_new_session=True)

    def wait_ready(self, timeout_s: float = 180.0) -> "TierserveReplica":
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert self.proc.poll() is None, f"replica {self.name} exited"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"replica {self.name} not ready in {timeout_s} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def spec(self, kind: str = "tierserve", **kw) -> ReplicaSpec:
        kw.setdefault("max_num_seqs", 16)
        kw.setdefault("price_per_hour", PRICE)
        return ReplicaSpec(self.url, [MODEL], kind, name=self.name, **kw)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 60.0) -> None:
    """Until `url`/health answers 200; the process's log in the failure if it exits."""
    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, f"{url} not ready in {timeout_s} s"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


class Gateway:
    """The tierserve server in fleet mode, in this process, on a loopback port."""

    def __init__(self, specs: list[ReplicaSpec], settings=None, flow: FlowConfig | None = None,
                 slo=None, health_interval_s: float = 0.5):
        import uvicorn

        from tierserve.model.metadata import default_model_path
        from tierserve.model.tokenizer import Tokenizer
        from tierserve.router.fleet import FleetBackend
        from tierserve.server.app import create_app
        from tierserve.server.settings import ServerSettings

        settings = settings or ServerSettings()
        settings.port = self.port = free_port()
        self.backend = FleetBackend(specs, MODEL, StepTimeModel.load(DEFAULT_CPU_PROFILE),
                                    flow or FlowConfig(), slo,
                                    Tokenizer.load(str(default_model_path())),
                                    health_interval_s=health_interval_s)
        self.app = create_app(self.backend, settings, MODEL)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "gateway did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "none"):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def check_schema_and_tool_call(client) -> None:
    """Through a gateway: a nested JSON schema's answer validates, and a required tool
    call names the tool and its arguments validate."""
    import json

    from test_grammar import NESTED_SCHEMA, conforms
    from test_openai_surface import WEATHER
    ask = [{"role": "user", "content": "Describe a pet as JSON."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, temperature=0,
                                       max_tokens=200, response_format={
                                           "type": "json_schema", "json_schema": {
                                               "name": "pet", "schema": NESTED_SCHEMA}})
    assert conforms(json.loads(r.choices[0].message.content), NESTED_SCHEMA)
    t = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                       tool_choice="required", max_tokens=120, temperature=0)
    call = t.choices[0].message.tool_calls[0]
    assert t.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert conforms(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
