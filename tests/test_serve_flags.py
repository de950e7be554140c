"""`tierserve serve` flags as `vllm serve` has them, and how flags and the YAML combine.

The HTTP checks start real `tierserve serve` processes (dummy weights of the SmolLM2 shape,
so they start in seconds) and talk to them over 127.0.0.1.
"""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tierserve.cli import build_parser, main
from tierserve.config import ModelConfig
from tierserve.engine_args import Remember, RememberSwitch
from tierserve.errors import ConfigError
from tierserve.server.serve import build

openai = pytest.importorskip("openai")
KEY = "sk-flag-key-0123"
YAML_KEY = "sk-yaml-key-4567"
PROMPT = list(range(1000, 1080))  # token ids: dummy weights come with no tokenizer


def serve_args(tmp_path, yaml: dict, *argv: str):
    cfg = tmp_path / "tierserve.yaml"
    cfg.write_text(json.dumps(yaml))
    return build_parser().parse_args(["serve", "--config", str(cfg), *argv])


def test_a_flag_given_beats_the_yaml_even_at_its_default(tmp_path):
    args = serve_args(tmp_path, {"max_num_seqs": 8, "port": 9001, "dtype": "float32",
                                 "enable_prefix_caching": False, "disable_fastapi_docs": True,
                                 "flex_max_wait_s": 5},
                      "--max-num-seqs", "64", "--port", "8000", "--dtype", "auto",
                      "--enable-prefix-caching")
    settings, config, _ = build(args)
    assert config.scheduler.max_num_seqs == 64 and settings.port == 8000
    assert config.model.dtype == "bfloat16" and config.cache.enable_prefix_caching
    assert config.scheduler.flex_max_wait_s == 5          # not given: the YAML's
    assert settings.disable_fastapi_docs


def test_every_serve_flag_is_remembered():
    """Each flag a YAML key can also set must note that it was given; otherwise the YAML
    would override a flag given at its default value."""
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    exempt = {"help", "config", "backend"}  # backend: the flag's list replaces the YAML's
    loose = [a.option_strings[0] for a in sub._actions if a.option_strings
             and a.dest not in exempt and not isinstance(a, (Remember, RememberSwitch))]
    assert not loose, f"flags a YAML value would override: {loose}"


def test_dtype_auto_is_the_engines_dtype():
    assert ModelConfig(dtype="auto").dtype == "bfloat16"
    assert ModelConfig(dtype="float32").dtype == "float32"
    args = build_parser().parse_args(["generate", "hi", "--dtype", "auto"])
    assert args.dtype == "bfloat16"                      # what the benchmarks echo


def test_api_key_sources_and_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSERVE_API_KEY", "sk-from-env-999")
    yaml = {"api_key": "sk-from-yaml-888",
            "api_keys": {YAML_KEY: {"tenant": "team-a", "tiers": ["flex"]}}}
    settings, _, _ = build(serve_args(tmp_path, yaml, "--api-key", KEY))
    assert settings.api_keys[KEY].name == "api-key"      # the flag beats env and YAML
    assert settings.api_keys[YAML_KEY].name == "team-a"   # beside the YAML's keys
    assert set(settings.api_keys) == {KEY, YAML_KEY}
    settings, _, _ = build(serve_args(tmp_path, yaml))
    assert "sk-from-env-999" in settings.api_keys        # the environment beats the file
    monkeypatch.delenv("TIERSERVE_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")         # deliberately not read
    settings, _, _ = build(serve_args(tmp_path, {}))
    assert settings.api_keys == {}
    with pytest.raises(ConfigError, match="must not be empty"):
        build(serve_args(tmp_path, {}, "--api-key", " "))


def test_plot_without_matplotlib_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code = main(["bill", "--ledger", str(tmp_path / "none.db"), "--plot", "x.png"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --plot needs matplotlib: pip install 'tierserve[plot]'"


# ------------------------------------------------------------------ over HTTP
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tierserve serve` on dummy weights, stdout (the access log) kept in a file."""

    def __init__(self, tmp_path, name: str, *argv: str, env: dict | None = None):
        self.port, self.out = free_port(), tmp_path / f"{name}.out"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(self.port),
             "--load-format", "dummy", "--model", "smollm2-135m", "--num-kv-blocks", "64",
             "--priority-step-time-s", "0", "--no-ledger", "--no-batches", *argv],
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            stdout=open(self.out, "wb"), stderr=open(tmp_path / f"{name}.err", "wb"))

    def wait_ready(self, timeout_s: float = 180) -> "Server":
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert self.proc.poll() is None, "server exited"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError("server not ready")

    def client(self, key: str):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def cached_tokens(self, key: str) -> int:
        r = self.client(key).completions.create(model="smollm2-135m", prompt=PROMPT,
                                                max_tokens=2)
        return r.usage.prompt_tokens_details.cached_tokens

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A: --api-key beside a YAML key, no docs, access log on (the default). B: the key
    from the environment, no access log, no prefix caching. Started together."""
    tmp = tmp_path_factory.mktemp("serve-flags")
    (tmp / "keys.yaml").write_text(json.dumps({"api_keys": {YAML_KEY: {"tenant": "team-a"}}}))
    a = Server(tmp, "a", "--api-key", KEY, "--config", str(tmp / "keys.yaml"),
               "--disable-fastapi-docs")
    b = Server(tmp, "b", "--disable-uvicorn-access-log", "--no-enable-prefix-caching",
               env={"TIERSERVE_API_KEY": KEY})
    try:
        yield a.wait_ready(), b.wait_ready()
    finally:
        a.stop()
        b.stop()


def test_api_key_is_required_with_openai_errors(servers):
    a, b = servers
    for srv in (a, b):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            r = httpx.get(srv.url + "/v1/models", headers=headers)
            assert r.status_code == 401
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert srv.client(KEY).models.list().data[0].id == "smollm2-135m"
        assert httpx.get(srv.url + "/health").status_code == 200      # stays open
    assert a.client(YAML_KEY).models.list().data                      # the YAML's key too
    with pytest.raises(openai.AuthenticationError):
        b.client(YAML_KEY).models.list()


def test_docs_switch(servers):
    a, b = servers
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(a.url + path).status_code == 404
        assert httpx.get(b.url + path).status_code == 200


def test_access_log_switch(servers):
    a, b = servers
    for srv in (a, b):
        httpx.get(srv.url + "/version")
    deadline = time.time() + 10
    while '"GET /version HTTP/1.1" 200' not in a.out.read_text():
        assert time.time() < deadline, "no access line on stdout"
        time.sleep(0.1)
    assert "GET /" not in b.out.read_text()


def test_prefix_caching_switch(servers):
    a, b = servers
    a.cached_tokens(KEY)
    assert a.cached_tokens(KEY) > 0                        # on: the repeat hits the cache
    assert b.cached_tokens(KEY) == 0 and b.cached_tokens(KEY) == 0
