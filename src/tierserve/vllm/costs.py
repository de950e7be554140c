"""What the plugin's scheduler knows of costs, and how the API server asks for it.

The scheduler runs in vLLM's engine-core process and the HTTP routes in the API server's,
so the engine core keeps a `CostBook` (each finished request's exact cost, by the key the
gateway gave it, and the replica's totals per tier) and answers over a Unix socket: one
line in (`info`, `totals`, `costs ["key", ...]`, or `steps AFTER`: the step log's records
with ids above AFTER), one JSON line out. The middleware
(middleware.py) is the client. The socket is named by the API server's process id, which
is the engine core's parent in a plain `vllm serve` ($TIERSERVE_VLLM_SOCKET names it when
it is not).
"""

import json
import os
import socket
import socketserver
import threading
import time
from collections import OrderedDict

from tierserve.core.step_log import StepLog

ENDING_WAIT_S = 1.0
"""How long a `costs` question waits for a request that ended but whose last step is not
back yet (a step takes milliseconds; this bounds a stuck engine)."""
MAX_KEPT = 100_000
"""Finished requests whose cost is kept for a gateway to read (oldest dropped first)."""
ENV_SOCKET = "TIERSERVE_VLLM_SOCKET"
"""The socket's path, for both processes (they share the environment); unset: named after
the API server's process id."""


def socket_path(api_server_pid: int | None = None) -> str:
    """The socket's path: $TIERSERVE_VLLM_SOCKET, else by the API server's process id
    (the engine core's parent, None: this process's parent)."""
    if os.environ.get(ENV_SOCKET):
        return os.environ[ENV_SOCKET]
    pid = os.getppid() if api_server_pid is None else api_server_pid
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tierserve-vllm-{pid}.sock")


class CostBook:
    """Exact costs, written by the scheduler's thread and read by the socket's. Idle time
    since the last step is added when the totals are read (while no request is in the
    engine), so a replica that sits idle shows its idle cost growing."""

    def __init__(self, info: dict, price_per_hour: float = 0.0, clock=time.monotonic):
        self.info = dict(info)
        self.price_per_s = price_per_hour / 3600
        self.clock = clock
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)
        self._ending: set[str] = set()
        self._finished: OrderedDict[str, dict] = OrderedDict()
        self._by_tier: dict[str, dict] = {}
        self.idle_usd = 0.0
        self.machine_usd = 0.0
        self._at: float | None = None
        self._busy = False
        self.step_log: StepLog | None = None
        """The engine core's recent steps (`steps AFTER`)."""

    def note(self, **info) -> None:
        """Update what `info` answers (the fitted model, the cap in force)."""
        with self._lock:
            self.info.update(info)

    def ending(self, key: str) -> None:
        """The request `key` ended; its cost lands once its last step is back."""
        with self._lock:
            self._ending.add(key)

    def finished(self, key: str, tier: str, record: dict) -> None:
        with self._lock:
            self._ending.discard(key)
            self._landed.notify_all()
            self._finished[key] = record
            self._finished.move_to_end(key)
            while len(self._finished) > MAX_KEPT:
                self._finished.popitem(last=False)
            t = self._by_tier.setdefault(tier, {"prefill_usd": 0.0, "decode_usd": 0.0,
                                                "requests": 0, "refused": 0})
            t["prefill_usd"] += record.get("prefill_usd", 0.0)
            t["decode_usd"] += record.get("decode_usd", 0.0)
            t["requests"] += 1
            t["refused"] += bool(record.get("refused"))

    def set_machine(self, machine_usd: float, idle_usd: float, at: float,
                    busy: bool) -> None:
        """The meter's totals as of `at` (the end of the last step); `busy`: requests
        are in the engine (their time is not idle)."""
        with self._lock:
            self.machine_usd, self.idle_usd, self._at, self._busy = (machine_usd, idle_usd,
                                                                     at, busy)

    def answer(self, line: str) -> dict:
        command, _, arg = line.strip().partition(" ")
        if command == "steps":   # the step log keeps its own lock
            if self.step_log is None:
                return {"error": "this engine core keeps no step log"}
            data, last_id = self.step_log.after(int(arg or 0))
            return {"data": data, "last_id": last_id}
        with self._lock:
            if command == "info":
                return dict(self.info)
            if command == "totals":
                since = 0.0 if self._busy or self._at is None else \
                    max(0.0, self.clock() - self._at) * self.price_per_s
                return {"by_tier": {t: dict(v) for t, v in self._by_tier.items()},
                        "idle_usd": self.idle_usd + since,
                        "machine_usd": self.machine_usd + since}
            if command == "costs":
                keys = json.loads(arg or "[]")
                self._landed.wait_for(lambda: not self._ending.intersection(keys),
                                      ENDING_WAIT_S)
                return {k: self._finished[k] for k in keys if k in self._finished}
        return {"error": f"unknown command {command!r}"}


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):
        line = self.rfile.readline().decode()
        try:
            out = self.server.book.answer(line)
        except (ValueError, TypeError) as exc:
            out = {"error": str(exc)}
        self.wfile.write(json.dumps(out).encode() + b"\n")


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve(book: CostBook, path: str) -> _Server:
    """Answer `book`'s questions on the Unix socket `path` from a daemon thread."""
    if os.path.exists(path):
        os.unlink(path)  # a socket left by a replica that was killed
    server = _Server(path, _Handler)
    server.book = book
    threading.Thread(target=server.serve_forever, name="tierserve-costs",
                     daemon=True).start()
    return server


def ask(path: str, line: str, timeout_s: float = 2.0) -> dict:
    """One question to the engine core's CostBook (OSError when it does not answer)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(line.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
