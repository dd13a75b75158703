"""How much host memory this process may still take: the machine's available memory, or less
where a cgroup (a Slurm job's, a container's) limits the process's group or one above it."""

from __future__ import annotations

from pathlib import Path

#: cgroup v2's mount and v1's memory hierarchy
CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_bytes() -> int:
    """Bytes this process can still allocate without swapping or meeting its cgroup's limit."""
    import psutil

    free = int(psutil.virtual_memory().available)
    room = cgroup_room()
    return free if room is None else min(free, room)


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """The least room (limit less usage) of this process's memory cgroup and its ancestors, or
    None where no limit is set or none can be read. The group's inactive page cache counts as
    room: usage includes it, and the kernel drops it before refusing an allocation (a job
    that wrote or read files has its group's usage near the limit otherwise)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:  # not ``id:controllers:path``
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one unified hierarchy
            base, limit, usage, cache = root, "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            base, limit, usage = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache = "total_inactive_file"  # v1's own ``inactive_file`` leaves out the groups below
        else:
            continue
        rooms = []
        group = base / path.lstrip("/")
        while True:
            try:
                cap = (group / limit).read_text().strip()
                if cap != "max":
                    used = int((group / usage).read_text().strip()) - _stat(group, cache)
                    rooms.append(max(int(cap) - used, 0))
            except (OSError, ValueError):
                pass  # a level without the files (the root) or unreadable: no limit known there
            if group == base or base not in group.parents:
                break
            group = group.parent
        return min(rooms) if rooms else None
    return None


def _stat(group: Path, key: str) -> int:
    """``key`` of the group's ``memory.stat`` (0 where it cannot be read)."""
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
