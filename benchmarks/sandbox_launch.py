"""What starting a sandboxed execution costs a node that runs as root and holds a model.

As root the sandbox runs each execution as an unprivileged user. Asked to switch users itself,
``subprocess.Popen`` cannot use ``vfork`` and copies the calling process's page tables for every
execution; a RaaS node holding torch and a model is large. This benchmark holds ``--host-mb`` of
memory in its own process, like such a node, and runs the same small program with one test
both ways, one after the other, several rounds:

* ``popen-user``: the previous way, ``Popen(..., user=, group=, extra_groups=)`` (fork);
* ``setpriv``: the sandbox's way, ``setpriv --reuid --regid --clear-groups`` in front of
  bubblewrap (Popen may use vfork).

It prints p50/p99 latency per execution and ends with ``RESULT {json}``: ``setpriv_vs_popen_user``,
the ratio of p50 latencies (below 1: faster). Needs root, bubblewrap and setpriv.

Run from the repository root: ``python benchmarks/sandbox_launch.py [--host-mb 1500] [--runs 40]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.sandbox import Sandbox, SandboxConfig  # noqa: E402
from astraflow.sandbox import core  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402

PROGRAM = "def add(a, b):\n    return a + b\n"
#: Popen as the sandbox uses it (``_PopenAsUser`` stands in for it while the previous way runs)
POPEN = subprocess.Popen
TESTS = "def test_add():\n    assert add(1, 2) == 3\n"


class _PopenAsUser(POPEN):
    """The previous launch: the user switch asked of Popen, not of setpriv."""

    def __init__(self, cmd, *args, **kwargs):
        if cmd and Path(cmd[0]).name == "setpriv":
            uid = int(cmd[1].split("=")[1])
            cmd = cmd[cmd.index("--") + 1:]
            kwargs.update(user=uid, group=uid, extra_groups=[])
        super().__init__(cmd, *args, **kwargs)


def measure(sb: Sandbox, runs: int) -> dict:
    lat = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = sb.run(PROGRAM, TESTS)
        lat.append(time.perf_counter() - t0)
        assert r.status == "ok", (r.status, r.stderr)
    lat.sort()
    return {"p50_ms": lat[len(lat) // 2] * 1000, "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host-mb", type=at_least(0), default=1500, help="memory this process holds, as a node would")
    ap.add_argument("--runs", type=at_least(1), default=40, help="executions per way and round")
    ap.add_argument("--rounds", type=at_least(1), default=2)
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        sys.exit("sandbox_launch: needs root and setpriv (util-linux): as another user no user switch happens")
    ballast = bytearray(args.host_mb << 20)
    for i in range(0, len(ballast), 4096):  # resident, as a loaded model is
        ballast[i] = 1
    sb = Sandbox(SandboxConfig())
    sb.check()
    rows: dict[str, list[dict]] = {"popen-user": [], "setpriv": []}
    for _ in range(args.rounds):
        for way in rows:
            core.subprocess.Popen = _PopenAsUser if way == "popen-user" else POPEN
            try:
                rows[way].append(measure(sb, args.runs))
            finally:
                core.subprocess.Popen = POPEN
    print(f"{'launch':12}{'p50 ms':>10}{'p99 ms':>10}   (host holding {args.host_mb} MB, {os.cpu_count()} cores)")
    for way, ms in rows.items():
        for m in ms:
            print(f"{way:12}{m['p50_ms']:>10.1f}{m['p99_ms']:>10.1f}")
    p50 = {way: sorted(m["p50_ms"] for m in ms)[len(ms) // 2] for way, ms in rows.items()}
    print("RESULT " + json.dumps({"setpriv_vs_popen_user": round(p50["setpriv"] / p50["popen-user"], 3),
                                  "setpriv_p50_ms": round(p50["setpriv"], 1),
                                  "popen_user_p50_ms": round(p50["popen-user"], 1), "host_mb": args.host_mb}))


if __name__ == "__main__":
    main()
