"""What forking the Megatron backend's local ranks from one server (``fork_ranks``) saves.

Side by side in one process, alternating, on the same tiny Llama checkpoint (TP=2, gloo on CPU):

* **fresh** (baseline, ``fork_ranks=False``): each rank is a new interpreter that imports
  torch, Megatron-core and the rank's modules itself;
* **forked** (the default): each rank is forked from the process's rank fork server, which
  imported them once (its start is counted in the first forked round and reported apart).

One round is what a backend start costs a trainer (a resume, a restart after a rank died): build
the backend, one forward for log-probs, close it. The CPU seconds of every process under this
one are sampled every 0.1 s while the round runs (what a rank spends in its last moments is
missed alike on both sides).

    python benchmarks/rank_fork.py [--rounds 3] [--tp 2]

Ends with ``RESULT {json}``: medians of both (the forked median over the rounds after the
first) and ``wall_ratio``, ``cpu_ratio`` (forked over fresh; below 1 is less).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.training.megatron import rank_server  # noqa: E402
from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402
from tests.megatron.helpers import loss_fn_name, prompts, save_tiny_llama  # noqa: E402


class TreeCPU:
    """CPU seconds this process's descendants (they come and go) spent while the block ran
    (one already running, the rank fork server, counts from the block's start)."""

    def __enter__(self) -> "TreeCPU":
        self.seen: dict[int, float] = {}
        self.before: dict[int, float] = {}
        for p in psutil.Process().children(recursive=True):
            try:
                t = p.cpu_times()
                self.before[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._done.is_set():
            for p in me.children(recursive=True):
                try:
                    t = p.cpu_times()
                    self.seen[p.pid] = t.user + t.system
                except psutil.Error:
                    pass
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        return sum(cpu - self.before.get(pid, 0.0) for pid, cpu in self.seen.items())


def one_round(hf_dir: Path, tp: int, fork: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the ranks and any server started meanwhile) of one start."""
    toks = prompts()
    cfg = MegatronBackendConfig(hf_checkpoint=str(hf_dir), tp_size=tp, lr=1e-3, loss_fn=loss_fn_name(),
                                start_timeout_s=300, fork_ranks=fork)
    t0 = time.perf_counter()
    with TreeCPU() as cpu:
        with MegatronBackend(cfg) as be:
            be.logprobs(toks)
    return time.perf_counter() - t0, cpu.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds of each (default 3)")
    ap.add_argument("--tp", type=at_least(1), default=2, help="tensor-parallel ranks per backend (default 2)")
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = save_tiny_llama(Path(tmp) / "hf", tied=True)
        rows: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(args.rounds):
            for fork in (False, True):
                wall, cpu = one_round(hf_dir, args.tp, fork)
                rows[fork].append((wall, cpu))
                console.print(f"round {r + 1}: {'forked' if fork else 'fresh '} {wall:6.1f} s wall {cpu:6.1f} s CPU")
        rank_server.close_rank_fork_server()
    fresh = rows[False]
    forked = rows[True][1:] or rows[True]
    med = {name: (statistics.median(w for w, _ in xs), statistics.median(c for _, c in xs))
           for name, xs in (("fresh", fresh), ("forked", forked), ("forked_first", rows[True][:1]))}
    table = Table(title=f"one Megatron backend start (TP={args.tp}, tiny Llama, CPU), medians of {args.rounds}")
    for col in ("ranks", "wall s", "CPU s"):
        table.add_column(col, justify="right")
    table.add_row("fresh (baseline)", f"{med['fresh'][0]:.1f}", f"{med['fresh'][1]:.1f}")
    table.add_row("forked, server's first", f"{med['forked_first'][0]:.1f}", f"{med['forked_first'][1]:.1f}")
    table.add_row("forked, later starts", f"{med['forked'][0]:.1f}", f"{med['forked'][1]:.1f}")
    console.print(table)
    result = {"tp": args.tp, "rounds": args.rounds,
              "fresh_wall_s": round(med["fresh"][0], 2), "fresh_cpu_s": round(med["fresh"][1], 2),
              "forked_first_wall_s": round(med["forked_first"][0], 2),
              "forked_wall_s": round(med["forked"][0], 2), "forked_cpu_s": round(med["forked"][1], 2),
              "wall_ratio": round(med["forked"][0] / med["fresh"][0], 3),
              "cpu_ratio": round(med["forked"][1] / med["fresh"][1], 3)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
