"""A tool's progress on stderr: one status line, rewritten in place on a terminal, a line every few seconds
otherwise."""

from __future__ import annotations

import statistics
import sys
import time


class Progress:
    """One status line on stderr: rewritten in place on a terminal, a line every few seconds otherwise."""

    def __init__(self, stream=None, every_s: float = 5.0, quiet: bool = False):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s, self.quiet = every_s, quiet
        self._last = 0.0
        self._open = False
        self.t0 = time.perf_counter()

    def elapsed(self) -> str:
        return f"{time.perf_counter() - self.t0:7.1f}s"

    def log(self, msg: str) -> None:
        if self.quiet:
            return
        self._end_line()
        print(f"[bench {self.elapsed()}] {msg}", file=self.stream, flush=True)

    def update(self, label: str, i: int, n: int, times_ms: list[float]) -> None:
        if self.quiet:
            return
        now = time.perf_counter()
        done = i >= n
        if not self.tty and not done and now - self._last < self.every_s:
            return
        self._last = now
        med = f"median {statistics.median(times_ms):.3f} ms" if times_ms else ""
        eta = ""
        if times_ms and not done:
            eta = f", ~{statistics.median(times_ms) * (n - i) / 1e3:.1f}s left"
        bar = "#" * int(20 * i / max(n, 1))
        line = f"[bench {self.elapsed()}] {label} [{bar:<20}] {i}/{n} {med}{eta}"
        if self.tty:
            print("\r" + line + " " * 4, end="", file=self.stream, flush=True)
            self._open = not done
            if done:
                print(file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def _end_line(self):
        if self._open:
            print(file=self.stream, flush=True)
            self._open = False
