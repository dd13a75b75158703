"""What the code sandbox costs per execution, next to a plain unsandboxed Python subprocess.

The same mix of programs (a small function with passing tests, one with a failing test) runs
through ``astraflow.sandbox.Sandbox`` (bubblewrap, limits, per-test results), with the tests in a
process of their own (the default) and in the program's interpreter (``isolate_tests: false``),
and through a plain ``python3 -I -B`` subprocess of the same interpreter on the program followed
by the tests, at concurrency 1 and 2. Reported: executions per second and p50/p99 latency of
each. The last line is ``RESULT {json}``: the sandbox's executions/s and p99 at concurrency 2,
its ratio to the plain subprocess (goal: at least 0.5) with isolated tests (the default) and
with shared ones, and isolated tests' ratio to shared ones.

Run from the repository root: ``python benchmarks/sandbox.py [--runs 60]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.sandbox import Sandbox, SandboxConfig  # noqa: E402
from astraflow.sandbox.bwrap import interpreter  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402

PROGRAMS = [
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
     "def test_small():\n    assert fib(10) == 55\n\ndef test_large():\n    assert fib(90) == 2880067194370816120\n"),
    ("def rev(s):\n    return s[::-1]\n",
     "def test_rev():\n    assert rev('abc') == 'cba'\n\ndef test_wrong():\n    assert rev('ab') == 'ab'\n"),
]


def plain(python: str, work: Path):
    def run(i: int) -> float:
        prog, tests = PROGRAMS[i % len(PROGRAMS)]
        path = work / f"p{i}.py"
        path.write_text(prog + "\n" + "".join(
            f"{line}\n" for line in [tests, "for _n, _f in list(globals().items()):",
                                     "    if _n.startswith('test_'):",
                                     "        try:\n            _f()\n        except AssertionError:\n            pass"]))
        t0 = time.perf_counter()
        subprocess.run([python, "-I", "-B", str(path)], capture_output=True, timeout=30)
        return time.perf_counter() - t0
    return run


def sandboxed(sb: Sandbox):
    def run(i: int) -> float:
        prog, tests = PROGRAMS[i % len(PROGRAMS)]
        t0 = time.perf_counter()
        r = sb.run(prog, tests)
        assert r.status in ("ok", "failure") and r.total == 2, (r.status, r.stderr)
        return time.perf_counter() - t0
    return run


def measure(fn, runs: int, concurrency: int) -> dict:
    fn(-1)  # warm the page cache
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        lat = sorted(pool.map(fn, range(runs)))
    wall = time.perf_counter() - t0
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000  # noqa: E731
    return {"executions_per_s": runs / wall, "p50_ms": pick(0.5), "p99_ms": pick(0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=at_least(1), default=60, help="executions per configuration")
    args = ap.parse_args()
    python = interpreter(SandboxConfig())
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in (1, 2):
            rows[("plain", c)] = measure(plain(python, Path(tmp)), args.runs, c)
            rows[("sandbox", c)] = measure(sandboxed(Sandbox(SandboxConfig(concurrency=c))), args.runs, c)
            rows[("shared", c)] = measure(sandboxed(Sandbox(SandboxConfig(concurrency=c, isolate_tests=False))),
                                          args.runs, c)
    print(f"{'':10}{'conc':>5}{'exec/s':>9}{'p50 ms':>9}{'p99 ms':>9}   ({os.cpu_count()} cores, {python})")
    for (kind, c), m in rows.items():
        print(f"{kind:10}{c:>5}{m['executions_per_s']:>9.1f}{m['p50_ms']:>9.1f}{m['p99_ms']:>9.1f}")
    best = rows[("sandbox", 2)]
    print("RESULT " + json.dumps({
        "ratio_vs_plain_subprocess": round(best["executions_per_s"] / rows[("plain", 2)]["executions_per_s"], 3),
        "ratio_vs_plain_subprocess_concurrency_1": round(
            rows[("sandbox", 1)]["executions_per_s"] / rows[("plain", 1)]["executions_per_s"], 3),
        "ratio_vs_plain_subprocess_shared_tests": round(
            rows[("shared", 2)]["executions_per_s"] / rows[("plain", 2)]["executions_per_s"], 3),
        "isolated_vs_shared_tests": round(best["executions_per_s"] / rows[("shared", 2)]["executions_per_s"], 3),
        "executions_per_s": round(best["executions_per_s"], 2), "p50_ms": round(best["p50_ms"], 1),
        "p99_ms": round(best["p99_ms"], 1), "concurrency": 2, "runs": args.runs}))


if __name__ == "__main__":
    main()
