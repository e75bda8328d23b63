"""The command-line tools' persistent compilation cache: XLA executables kept on disk, so a second run of the
same configuration (same programs, shapes, mesh, jax and XLA flags) loads its programs instead of compiling.

On by default in every CLI that compiles a model step (generate, bench, sweep, compile_time):

    directory   --compile-cache DIR  >  $JAXINFER_COMPILE_CACHE  >  $XDG_CACHE_HOME/jaxinfer/xla
                (else ~/.cache/jaxinfer/xla)
    disable     --compile-cache off  or  JAXINFER_COMPILE_CACHE=off

Every program is cached whatever its compile time (`jax_persistent_cache_min_compile_time_secs` 0). jax
keys an entry by the lowered program, the compile options, the devices and the jax / XLA versions, so a stale
entry is never used; the directory can be deleted at any time. `CacheEvents` counts what the cache did
while it is open (jax.monitoring events), so records say whether a program was a hit (loaded), a miss
(compiled and written) or compiled with the cache off.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

ENV = "JAXINFER_COMPILE_CACHE"
OFF = ("off", "none", "0", "false", "no")

_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"
_counts = {_REQUESTS: 0, _HITS: 0}
_lock = threading.Lock()
_listening = False


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxinfer" / "xla"


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-cache", metavar="DIR|off",
                        help=f"persistent compilation cache directory, or 'off' (default ${ENV}, else "
                             f"{default_dir()})")


def resolve(value: str | None) -> Path | None:
    """The cache directory a flag value (None: not given) selects, or None when the cache is off."""
    if value is None:
        value = os.environ.get(ENV)
    if value is None:
        return default_dir()
    if value.strip().lower() in OFF or not value.strip():
        return None
    return Path(value).expanduser()


def enable(value: str | None) -> Path | None:
    """Point jax's persistent compilation cache at `resolve(value)` (or turn it off) before the first compile;
    returns the directory in use (None: off)."""
    import jax

    directory = resolve(value)
    _listen()
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def _listen() -> None:
    global _listening
    if _listening:
        return
    import jax

    def count(event: str, **_) -> None:
        if event in _counts:
            with _lock:
                _counts[event] += 1

    jax.monitoring.register_event_listener(count)
    _listening = True


class CacheEvents:
    """Counts the compilation-cache lookups and hits while open: `with CacheEvents() as ev: compile ...`, then
    `ev.status` is "hit" (every lookup loaded a program), "miss" (none did), "partial", or "off" (no lookup:
    the cache is disabled)."""

    def __enter__(self) -> "CacheEvents":
        _listen()
        with _lock:
            self._start = dict(_counts)
        self.requests = self.hits = 0
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            self.requests = _counts[_REQUESTS] - self._start[_REQUESTS]
            self.hits = _counts[_HITS] - self._start[_HITS]

    @property
    def status(self) -> str:
        if not self.requests:
            return "off"
        if self.hits == self.requests:
            return "hit"
        return "miss" if not self.hits else "partial"

    def record(self) -> dict:
        return {"status": self.status, "lookups": self.requests, "hits": self.hits}
