"""math-verify comparisons in worker processes of their own, under a deadline that kills.

sympy evaluates what a completion writes. A power tower (``10^{10^{10}}``), the factorial of
a billion or an expanded ``(1+x)^{100000}`` runs on inside C code that holds the GIL: neither
math-verify's own SIGALRM timeout nor a reward thread's deadline can stop it, and the whole
process (a RaaS node's event loop, its heartbeats, its other rewards) stalls for hours. So the
``math_verify`` reward compares in a pool of worker processes: a comparison past
``DEADLINE_S`` kills its worker and scores 0 (an answer that cannot be checked earns nothing),
and a worker's address space is capped (``MEMORY_BYTES``), so that a number too big to hold
fails at once instead of exhausting the node's memory.

A worker is ``python -m astraflow.workloads.mathcheck [CPU_S]``: it reads one JSON request per line,
``[answer, text]``, and writes ``1`` or ``0`` per line. It imports no other astraflow module.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path

#: a comparison that has not answered after this long is killed with its worker (math-verify's
#: own limits, 5 s to parse and 5 s to compare, stop what runs long in Python code)
DEADLINE_S = 15.0
#: CPU seconds a worker may spend on one comparison before the kernel ends it (only an orphaned
#: worker gets there: the pool kills one past ``DEADLINE_S`` first)
ORPHAN_CPU_S = 2 * DEADLINE_S
#: how long a new worker may take to import math-verify
START_S = 120.0
#: the address space of a worker: far above what it needs, far below a node's memory
MEMORY_BYTES = 1 << 30
#: workers at most; more comparisons at once wait for a free one
MAX_WORKERS = max(1, min(8, os.cpu_count() or 1))

MINUS = str.maketrans({"\u2212": "-", "\u2013": "-"})  # the minus sign and the en dash written for it


# -- what a worker runs ------------------------------------------------------------------------


def mv_parse(text: str) -> list:
    """``text`` parsed by math-verify, bounded by its SIGALRM timeout where this is the main thread
    (only the main thread may set one)."""
    from math_verify import parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # not a warning per call about its timeout
    main = threading.current_thread() is threading.main_thread()
    return parse(text.translate(MINUS), parsing_timeout=5 if main else None)


@lru_cache(maxsize=4096)
def gold(answer: str) -> list:
    """A reference answer parsed once: every completion of its group is compared with it. Read
    as LaTeX (a MATH ``\\boxed{}`` content: ``4a`` is not the number 4), as text where that fails."""
    return mv_parse(f"\\boxed{{{answer}}}") or mv_parse(answer)


def compare(answer: str, text: str) -> bool:
    """Whether math-verify finds the answer written in ``text`` equal to the reference ``answer``."""
    from math_verify import verify

    pred = mv_parse(text)
    if not pred and "$" not in text and "\\" in text:
        pred = mv_parse(f"${text}$")  # a bare LaTeX answer (``\\frac{1}{2}``) as math
    if not pred:
        return False
    main = threading.current_thread() is threading.main_thread()
    return bool(verify(gold(answer), pred, timeout_seconds=5 if main else None))


def _serve() -> None:
    """A worker's loop: a request per line on stdin, ``1``/``0`` per line on the real stdout (what
    the libraries print goes to stderr)."""
    import resource

    import math_verify  # noqa: F401 -- before "ready": a missing package fails the start, not each comparison

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    out.write("ready\n")
    out.flush()
    cpu_s = float(sys.argv[1]) if len(sys.argv) > 1 else ORPHAN_CPU_S
    for line in sys.stdin:
        answer, text = json.loads(line)
        _cpu_limit(cpu_s)
        try:
            ok = compare(answer, text)
        except (MemoryError, RecursionError):  # a number or an expression too big to hold: no match
            ok = False
        out.write("1\n" if ok else "0\n")
        out.flush()


def _cpu_limit(seconds: float) -> None:
    """The kernel ends this worker (SIGXCPU) once the coming comparison has used ``seconds`` of CPU:
    the pool kills a worker past its deadline, but not one orphaned by a node that died meanwhile."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


# -- the pool ----------------------------------------------------------------------------------


class _Worker:
    """One worker process and its pipes."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # where the astraflow package is
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path})
        if self._line(START_S) != "ready":
            self.stop()
            raise RuntimeError(f"the math-verify worker ({sys.executable} -m {__name__}) did not start "
                               f"(exit code {self.proc.returncode}; its error is on stderr): is math-verify "
                               "installed in this environment?")

    def _line(self, timeout_s: float) -> str | None:
        """The worker's next line; None past ``timeout_s`` or when it has exited."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        return line.strip() if line else None

    def ask(self, answer: str, text: str) -> bool | None:
        """The worker's comparison; None (the worker killed) past ``DEADLINE_S`` or when it died."""
        try:
            self.proc.stdin.write(json.dumps([answer, text]) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died (killed for its memory by the kernel, say)
            self.stop()
            return None
        line = self._line(DEADLINE_S)
        if line not in ("0", "1"):
            self.stop()
            return None
        return line == "1"

    def stop(self) -> None:
        """Kill the worker and reap it (it may be deep in C code: no polite way out)."""
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a write to it failed already: closing flushes nothing
                pass


class Pool:
    """Up to ``size`` workers, started on demand and reused; ``equal`` is safe from any thread."""

    def __init__(self, size: int = MAX_WORKERS):
        self.pid = os.getpid()  # a forked child shares these pipes: it must start its own
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()

    def equal(self, answer: str, text: str) -> bool:
        """Whether the answer of ``text`` equals ``answer``; False when the comparison passed its
        deadline or its worker died (``RuntimeError`` when no worker starts at all)."""
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                worker = _Worker()
                with self._lock:
                    self._all.add(worker)
            ok = worker.ask(answer, text)
            with self._lock:
                if ok is None:
                    self._all.discard(worker)
                else:
                    self._idle.append(worker)
        return bool(ok)

    def close(self) -> None:
        """Stop every worker, busy ones too."""
        with self._lock:
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.stop()


_pool: Pool | None = None
_pool_lock = threading.Lock()


def equal(answer: str, text: str) -> bool:
    """``Pool.equal`` on this process's pool (started on the first call)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = Pool()
        pool = _pool
    return pool.equal(answer, text)


def close() -> None:
    """Stop this process's workers (at exit; a test that started them)."""
    with _pool_lock:
        pool = _pool
    if pool is not None and pool.pid == os.getpid():
        pool.close()


atexit.register(close)

if __name__ == "__main__":
    _serve()
