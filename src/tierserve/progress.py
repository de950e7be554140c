"""A one-line progress bar on stderr for long commands (`tierserve sim`, `batch --wait`).

Redrawn in place on a terminal, at most every `interval_s`; elsewhere (a log, CI) one
plain line at most every `log_interval_s`, so logs stay readable.
"""

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, stream=None, interval_s: float = 0.2,
                 log_interval_s: float = 10.0):
        self.label, self.total = label, max(total, 0)
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.interval_s = interval_s if self.tty else log_interval_s
        self.start = time.monotonic()
        self._last = -float("inf")
        self._drawn = False

    def line(self, done: int, note: str = "") -> str:
        elapsed = time.monotonic() - self.start
        frac = done / self.total if self.total else 1.0
        width = 24
        filled = int(round(width * min(frac, 1.0)))
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 and done < self.total else 0.0
        return (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                f"{100 * frac:3.0f}% {rate:.1f}/s eta {eta:.0f}s" + (f" {note}" if note else ""))

    def update(self, done: int, note: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        text = self.line(done, note)
        if self.tty:
            self.stream.write("\r" + text + "\033[K")
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self, done: int, note: str = "") -> None:
        self.update(done, note, force=True)
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
