"""The room a memory cgroup leaves (``host_memory.cgroup_room``) in the ``/proc/self/cgroup``
and cgroup file layouts found in the wild."""

from __future__ import annotations

from astraflow.rollout.host_memory import cgroup_room


def _group(where, limit, usage, stat=None, v1=False):
    where.mkdir(parents=True, exist_ok=True)
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
    (where / names[0]).write_text(f"{limit}\n")
    (where / names[1]).write_text(f"{usage}\n")
    if stat is not None:
        (where / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in stat.items()))


def test_reclaimable_page_cache_is_room(tmp_path):
    """A job that read or wrote files has them in its page cache, charged to its group: the
    kernel drops the inactive part before it refuses an allocation, so it counts as room (as
    the machine's available memory counts it)."""
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    _group(root / "job", 1000, 900, {"anon": 300, "inactive_file": 500, "active_file": 100})
    proc.write_text("0::/job\n")
    assert cgroup_room(proc, root) == 600
    _group(root / "memory" / "job", 1000, 900, {"cache": 600, "total_inactive_file": 500}, v1=True)
    proc.write_text("5:memory:/job\n1:name=systemd:/user.slice/a:b.scope\n")
    assert cgroup_room(proc, root) == 600


def test_a_line_of_another_form_is_passed_over(tmp_path):
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    _group(root / "job", 1000, 400)
    proc.write_text("garbage\n\n0::/job\n")
    assert cgroup_room(proc, root) == 600
    proc.write_text("no colons here\n")
    assert cgroup_room(proc, root) is None
