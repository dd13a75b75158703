"""Monitoring room: free space on the filesystems a run writes to, and how fast it falls.

A run that fills its disk stops cleanly and resumes, but on a multi-day run the user would
rather hear about it hours before. `DiskWatch` samples the free space of each filesystem
(the run directory's, and the trajectory store's where that is elsewhere) every `EVERY_S`
seconds, fits the trend over the last `WINDOW_S`, and says when the filesystem fills at that
rate. ``status`` shows it; the orchestrator warns once when a filesystem will fill within
`WARN_S` (and again within `URGENT_S`) once the trend has said so for `PERSIST_S`, on at least
`WARN_SPAN_S` of samples, and says a level at most once every `WARN_S`. A user quota
(``quota -s``, ``lfs quota``) can run out before the filesystem does: the filesystem's free
space is all a process can read.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

#: seconds between samples (a ``statfs`` on a parallel filesystem asks every storage target)
EVERY_S = 30.0
#: seconds of samples the trend is fitted over
WINDOW_S = 1800.0
#: the least span of samples that gives a trend (a few samples of noise say nothing)
MIN_SPAN_S = 120.0
#: the least span of samples a warning is given on (a run's first weight versions, written at
#: once, would otherwise look like a disk filling fast)
WARN_SPAN_S = WINDOW_S / 2
#: seconds the trend must go on saying so before a warning (a trend that swings, as free space
#: falls while a version is written and comes back when an old one is deleted, does not)
PERSIST_S = 600.0
#: a filesystem that fills within this many seconds at the current rate is warned about
WARN_S = 6 * 3600.0
#: ... and again within this many
URGENT_S = 3600.0


def gib(n: float) -> str:
    """Bytes as a short human figure (GiB with one decimal below 100, TiB above 1,024 GiB)."""
    g = n / 2**30
    if g >= 1024:
        return f"{g / 1024:.1f} TiB"
    return f"{g:.1f} GiB" if g < 100 else f"{g:.0f} GiB"


def hours(seconds: float) -> str:
    """A duration as minutes below two hours, else hours (days above two days)."""
    if seconds < 7200:
        return f"{max(seconds, 0) / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a store not made yet sits on its parent's
    filesystem)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


@dataclass
class _Filesystem:
    """The samples of one filesystem and the run's places on it."""

    path: Path
    places: list[str]
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0
    #: per warning level (``WARN_S``, ``URGENT_S``): when it was last said
    warned: dict[float, float] = field(default_factory=dict)
    #: since when the trend has said "full within ``WARN_S``" without a break (None: it does not)
    filling_since: float | None = None
    #: what the latest sample says (``measure``; None before the first): the status reads it each tick
    latest: dict[str, Any] | None = None

    def falling_per_s(self) -> float | None:
        """Bytes per second the free space falls by (least squares over the window; negative:
        it grows), or None without ``MIN_SPAN_S`` of samples."""
        if len(self.samples) < 3 or self.samples[-1][0] - self.samples[0][0] < MIN_SPAN_S:
            return None
        t0 = self.samples[0][0]
        ts = [t - t0 for t, _ in self.samples]
        fs = [float(f) for _, f in self.samples]
        mt, mf = sum(ts) / len(ts), sum(fs) / len(fs)
        var = sum((t - mt) ** 2 for t in ts)
        return -sum((t - mt) * (f - mf) for t, f in zip(ts, fs)) / var if var else None

    def measure(self) -> dict[str, Any]:
        free = self.samples[-1][1]
        falling = self.falling_per_s()
        full_in = free / falling if falling and falling > 0 else None
        return {"path": str(self.path), "places": self.places, "free_bytes": free, "total_bytes": self.total,
                "falling_bytes_per_h": falling * 3600 if falling is not None else None, "full_in_s": full_in}


def run_places(run_dir: Path, store_url: str) -> dict[str, Path]:
    """What a run writes to, by name: its directory, and its trajectory store where that is a
    directory outside it (a ``memory://`` store has no disk)."""
    places = {"run directory": Path(run_dir)}
    if store_url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        store_url = unquote(urlparse(store_url).path)
    if "://" not in store_url and not Path(store_url).absolute().is_relative_to(Path(run_dir).absolute()):
        places["trajectory store"] = Path(store_url)
    return places


class DiskWatch:
    """The free space of the filesystems under ``places`` (name -> path), sampled every
    ``every_s`` (module docstring). ``advice``: what the warning says to do; ``usage``: how a
    filesystem's total and free bytes are read (``shutil.disk_usage``)."""

    def __init__(self, places: dict[str, Path], advice: str = "free space there", every_s: float = EVERY_S,
                 usage: Callable[[Path], Any] = shutil.disk_usage):
        self.every_s, self.advice, self.usage = every_s, advice, usage
        self._filesystems: dict[int, _Filesystem] = {}
        for name, path in places.items():
            where = _existing(Path(path).absolute())
            try:
                dev = os.stat(where).st_dev
            except OSError:  # gone between the check and the stat: nothing to watch there
                continue
            fs = self._filesystems.setdefault(dev, _Filesystem(where, []))
            fs.places.append(name)
        self._last = float("-inf")

    def sample(self, now: float | None = None) -> list[str]:
        """Sample every filesystem when ``every_s`` has passed (``now``: seconds on a monotonic
        clock); the warnings now due (one line each, said once per level)."""
        now = time.monotonic() if now is None else now  # a clock step neither pauses nor skews it
        if now - self._last < self.every_s:
            return []
        self._last = now
        warnings = []
        for fs in self._filesystems.values():
            try:
                usage = self.usage(fs.path)
            except OSError:  # unmounted or unreachable for now: the next sample tries again
                continue
            fs.total = usage.total
            fs.samples.append((now, usage.free))
            while fs.samples and now - fs.samples[0][0] > WINDOW_S:
                fs.samples.popleft()
            fs.latest = fs.measure()
            if line := _warning(fs, fs.latest):
                warnings.append(f"{line}: {self.advice}")
        return warnings

    def view(self) -> list[dict[str, Any]]:
        """Per filesystem sampled: its path, the run's places on it, free and total bytes, how
        fast the free space falls (bytes an hour; None before a trend) and when it fills at
        that rate (seconds; None when it does not fall)."""
        return [fs.latest for fs in self._filesystems.values() if fs.latest is not None]


def _warning(fs: _Filesystem, view: dict[str, Any]) -> str | None:
    """The line to say for ``fs`` (whose latest ``view`` this is) now, if any: the tightest level
    it passed (for ``PERSIST_S``), when that level was not said within the last ``WARN_S``."""
    full_in = view["full_in_s"]
    now = fs.samples[-1][0]
    if full_in is None or full_in > WARN_S:
        fs.filling_since = None
        return None
    fs.filling_since = now if fs.filling_since is None else fs.filling_since
    if now - fs.samples[0][0] < WARN_SPAN_S or now - fs.filling_since < PERSIST_S:
        return None
    level = URGENT_S if full_in <= URGENT_S else WARN_S
    if now - fs.warned.get(level, float("-inf")) < WARN_S:
        return None
    fs.warned.update({lv: now for lv in (WARN_S, URGENT_S) if lv >= level})  # an urgent one says both
    return (f"the filesystem of {fs.path} ({', '.join(fs.places)}) has {gib(view['free_bytes'])} free and loses "
            f"{gib(view['falling_bytes_per_h'])} an hour: full in about {hours(full_in)}, and then the run stops "
            "(it resumes once there is room)")


def disk_line(entry: dict[str, Any]) -> str:
    """One line of ``astraflow status`` for a filesystem of ``DiskWatch.view``."""
    free, total = entry.get("free_bytes") or 0, entry.get("total_bytes") or 0
    line = f"  {', '.join(entry.get('places') or [])}: {gib(free)} free of {gib(total)} on {entry.get('path')}"
    falling = entry.get("falling_bytes_per_h")
    if falling is None:
        return line
    if entry.get("full_in_s") is None:
        return line + "  (not falling)"
    return line + f"  (falling {gib(falling)}/h: full in ~{hours(entry['full_in_s'])})"
