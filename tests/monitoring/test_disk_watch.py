"""Free space on the run's filesystems: the trend, the warnings said once per level, and what
``astraflow status`` and ``status --json`` show of it."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from pathlib import Path

from astraflow.runtime.monitoring import StatusWriter, build_status_view, format_status, run_status
from astraflow.runtime.monitoring.disk import URGENT_S, WARN_S, DiskWatch, disk_line, run_places
from astraflow.runtime.monitoring.snapshot import write_orchestrator_info
from storage.paths import RunPaths

from tests.monitoring.test_status_files import _tick, _writer

Usage = namedtuple("Usage", "total used free")
GIB = 2**30


class Disk:
    """A filesystem whose free space the test sets (what ``statfs`` would say)."""

    def __init__(self, free_gib: float, total_gib: float = 1000.0):
        self.free, self.total = free_gib * GIB, total_gib * GIB
        self.asked: list[Path] = []

    def __call__(self, path: Path) -> Usage:
        self.asked.append(path)
        return Usage(int(self.total), int(self.total - self.free), int(self.free))


def _falling(watch: DiskWatch, disk: Disk, gib_per_h: float, start: float, minutes: int) -> list[str]:
    """Samples every 30 s for ``minutes`` while ``disk`` loses ``gib_per_h``; the warnings said."""
    said = []
    for i in range(minutes * 2):
        said += watch.sample(now=start + 30.0 * i)
        disk.free -= gib_per_h * GIB / 120
    return said


def test_a_filesystem_filling_within_hours_is_warned_about_once_per_level(tmp_path):
    disk = Disk(free_gib=120.0)
    watch = DiskWatch({"run directory": tmp_path}, advice="free space there", usage=disk)
    # 20 GiB/h from 120 GiB: under WARN_S left from the start, but said only on a quarter hour of samples
    assert _falling(watch, disk, 20.0, start=1000.0, minutes=14) == []
    said = _falling(watch, disk, 20.0, start=1000.0 + 14 * 60, minutes=10)
    assert len(said) == 1
    assert f"the filesystem of {tmp_path} (run directory)" in said[0] and "full in about 5." in said[0]
    assert said[0].endswith(": free space there") and "resumes" in said[0]
    view = watch.view()[0]
    assert abs(view["falling_bytes_per_h"] / GIB - 20.0) < 0.5
    assert view["full_in_s"] is not None and URGENT_S < view["full_in_s"] < WARN_S
    # the same level is not said again; the urgent one is, once
    said = _falling(watch, disk, 20.0, start=1000.0 + 24 * 60, minutes=300)
    assert len(said) == 1 and "full in about" in said[0]
    assert watch.view()[0]["full_in_s"] <= URGENT_S


def test_a_burst_at_the_start_or_space_that_comes_back_is_not_a_disk_filling_up(tmp_path):
    """The first weight versions written at once, then little: no warning. Free space that falls
    as a version is written and comes back when an old one is deleted: at most one warning."""
    disk = Disk(free_gib=300.0)
    watch = DiskWatch({"run directory": tmp_path}, usage=disk)
    said = watch.sample(now=0.0)
    disk.free -= 15 * GIB
    said += _falling(watch, disk, 1.0, start=30.0, minutes=180)
    assert said == []
    disk = Disk(free_gib=20.0)
    watch = DiskWatch({"run directory": tmp_path}, usage=disk)
    said = []
    for i in range(12 * 120):  # 12 h: 5 GiB written over 10 minutes, deleted at once, again
        said += watch.sample(now=30.0 * i)
        disk.free += 5 * GIB if i % 20 == 19 else -5 * GIB / 19
    assert len(said) <= 1, said


def test_a_steady_filesystem_is_not_warned_about_and_a_level_is_said_again_after_hours(tmp_path):
    disk = Disk(free_gib=5.0)
    watch = DiskWatch({"run directory": tmp_path}, usage=disk)
    assert _falling(watch, disk, 0.0, start=0.0, minutes=40) == []  # little room, but not falling
    assert watch.view()[0]["full_in_s"] is None
    disk.free = 60 * GIB
    said = _falling(watch, disk, 10.0, start=2400.0, minutes=60)
    assert len(said) == 1  # not again within WARN_S, though the disk keeps filling
    disk.free = 900 * GIB  # space freed; hours later the disk fills again: said again
    assert _falling(watch, disk, -10.0, start=6000.0, minutes=300) == []
    disk.free = 40 * GIB
    assert len(_falling(watch, disk, 10.0, start=6000.0 + WARN_S, minutes=60)) == 1


def test_no_trend_before_two_minutes_of_samples_and_samples_only_every_period(tmp_path):
    disk = Disk(free_gib=1.0)
    watch = DiskWatch({"run directory": tmp_path}, usage=disk, every_s=30.0)
    assert watch.view() == []  # nothing sampled yet: nothing to show
    watch.sample(now=0.0)
    watch.sample(now=10.0)  # within the period: not sampled again
    assert len(disk.asked) == 1
    disk.free -= GIB / 2
    watch.sample(now=60.0)
    view = watch.view()[0]
    assert view["falling_bytes_per_h"] is None and view["full_in_s"] is None and view["free_bytes"] == GIB // 2


def test_places_on_one_filesystem_are_one_entry_and_a_store_elsewhere_is_its_own(tmp_path):
    run = tmp_path / "run"
    assert run_places(run, str(run / "trajectories")) == {"run directory": run}
    assert run_places(run, "memory://x") == {"run directory": run}
    assert run_places(run, f"file://{tmp_path}/store%20a") == {"run directory": run,
                                                               "trajectory store": tmp_path / "store a"}
    # neither made yet: each is sampled on the nearest directory that exists, one filesystem
    watch = DiskWatch(run_places(run, str(tmp_path / "shared" / "store")), usage=shutil.disk_usage)
    watch.sample(now=0.0)
    (entry,) = watch.view()
    assert entry["places"] == ["run directory", "trajectory store"] and entry["path"] == str(tmp_path)
    assert entry["total_bytes"] > 0


def test_status_and_its_json_show_the_filesystems(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    writer, _ = _writer(paths)
    assert isinstance(writer, StatusWriter)
    disk = Disk(free_gib=120.0, total_gib=2048.0)
    watch = DiskWatch({"run directory": paths.root}, usage=disk)
    _falling(watch, disk, 2.0, start=0.0, minutes=10)
    writer.disk = watch.view
    write_orchestrator_info(paths, None, None)
    writer.write(_tick(4))
    text = format_status(run_status(paths.root))
    assert text.startswith(f"run {paths.root} (pid {os.getpid()} on ")  # what `astraflow stop` signals
    assert f"disk:\n  run directory: 120 GiB free of 2.0 TiB on {paths.root}  (falling 2.0 GiB/h: full in ~2.5 days)" \
        in text
    (view,) = build_status_view(paths.root).disk
    assert view.places == ["run directory"] and view.total_bytes == 2048 * GIB
    assert view.full_in_s is not None and 50 * 3600 < view.full_in_s < 70 * 3600
    assert disk_line({"places": ["run directory"], "free_bytes": GIB, "total_bytes": 2 * GIB, "path": "/x",
                      "falling_bytes_per_h": -1.0, "full_in_s": None}).endswith("(not falling)")
