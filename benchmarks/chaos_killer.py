"""The chaos killer: SIGKILLs the parts of a real ``astraflow run`` at seeded random times and
waits until each part is back.

What it kills, found by PID in the files the run writes (``control/status.json``: worker job ids
``local-<pid>``, the engine PIDs each RaaS node reports; the CLI process it started itself):

* ``node``: a RaaS node's worker (the orchestrator requeues its leases and refills the partition);
* ``engine``: a node's engine process (the node restarts it; only with ``rollout.engine.process``);
* ``trainer``: the trainer's worker (re-placed, resumed from the newest committed version);
* ``data``: the data layer's worker (re-placed from ``control/dataflow.snapshot``);
* ``orchestrator``: the ``astraflow run`` process itself, followed by what a user does: the same
  command again on the same run directory (the resume).

A kill counts as recovered when its part is back (a new node serving; the node's engine
restarted and completing episodes again; a restart recorded in ``status.json``; the resumed
incarnation's status) and the trainer has committed a version past the one of the kill. The
next kill waits for that, then a seeded exponential gap, so a replacement is never killed before it finished. Node kills are kept below
the partition's crash-loop limit (``runtime.reconcile.FAILURES_PER_NODE`` failures per node mark
it failed, by design) and the run's last steps are left alone so that it can finish.

After the orchestrator kill, the processes of the dead incarnation (its workers and their
engines) that are still alive once the resumed one has recorded itself in
``control/orchestrator.json`` are counted (``orphans``) and only then killed by PID: a product
that stops them itself at resume makes that count 0.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from astraflow.runtime.reconcile import FAILURES_PER_NODE
from storage.paths import RunPaths

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("node", "engine", "trainer", "data", "orchestrator")


#: seconds a process of the killed incarnation may take to be gone once the resumed one recorded
#: itself (a process the kernel is tearing down, its parent's death signal delivered, is still listed)
EXIT_GRACE_S = 2.0


def proc_identity(pid: int) -> tuple[int, int] | None:
    """``(pid, start time in clock ticks)`` of a live process (None when gone or a zombie): a
    PID recorded with its start time is never mistaken for a later process given that PID."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else (pid, int(fields[19]))


def alive(ident: tuple[int, int]) -> bool:
    return proc_identity(ident[0]) == ident


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def sigkill(ident: tuple[int, int]) -> bool:
    """SIGKILL the process ``ident`` names, only while it is that process."""
    if not alive(ident):
        return False
    try:
        os.kill(ident[0], signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


class CliRun:
    """``astraflow run CONFIG --run-dir RUN --set ...`` in a subprocess, as a user runs it;
    ``start()`` again on the same directory is the user's resume. Output goes to ``log``."""

    def __init__(self, config: Path, run_dir: Path, sets: list[str], log: Path, quiet: bool = False):
        self.cmd = [sys.executable, "-m", "astraflow", "run", str(config), "--run-dir", str(run_dir),
                    *(["--quiet"] if quiet else []), *[a for s in sets for a in ("--set", s)]]
        self.paths = RunPaths(run_dir)
        self.log = log
        self.incarnations: list[subprocess.Popen] = []
        #: every worker and engine process of the run seen in its status file
        self.seen: set[tuple[int, int]] = set()
        #: ``{pid: (worker, why)}`` of every worker the status file showed gone, and why
        self.losses: dict[int, tuple[str, str]] = {}

    @property
    def proc(self) -> subprocess.Popen:
        return self.incarnations[-1]

    def start(self) -> subprocess.Popen:
        with open(self.log, "ab") as out:
            out.write(f"\n$ {' '.join(self.cmd)}\n".encode())
            out.flush()
            self.incarnations.append(subprocess.Popen(self.cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL))
        return self.proc

    def status(self) -> dict[str, Any] | None:
        """``control/status.json`` (None before the first one, or while it is replaced)."""
        try:
            st = json.loads(self.paths.status_file.read_text())
        except (FileNotFoundError, ValueError):
            return None
        for ident in filter(None, map(proc_identity, worker_pids(st).values())):
            self.seen.add(ident)
        for ident in filter(None, (proc_identity(pid) for _, pid in engine_pids(st))):
            self.seen.add(ident)
        for n, w in st.get("workers", {}).items():
            if w.get("phase") == "gone" and w["job_id"].startswith("local-"):
                self.losses.setdefault(int(w["job_id"].removeprefix("local-")), (n, w.get("note") or "?"))
        return st

    def orchestrator_pid(self) -> int | None:
        try:
            return int(json.loads(self.paths.orchestrator_file.read_text())["pid"])
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def config(self) -> dict[str, Any]:
        return yaml.safe_load(self.paths.config.read_text())

    def wait(self, timeout: float) -> int | None:
        """The exit code of the current incarnation, or None if it still runs after ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> list[int]:
        """Stop the CLI (SIGTERM, then SIGKILL) if it still runs, then any process of the run
        still alive (by PID, as recorded); returns the PIDs that had to be killed."""
        if self.incarnations and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(60) is None:
                self.proc.kill()
                self.proc.wait(30)
        time.sleep(1.0)
        return [ident[0] for ident in sorted(self.seen) if sigkill(ident)]


def worker_pids(st: dict[str, Any], role: str | None = None, phase: str | None = None) -> dict[str, int]:
    """``{worker name: pid}`` of the run's local workers in ``status.json`` that are not gone."""
    roles = {n: p.get("role") for n, p in st.get("partitions", {}).items()}
    return {n: int(w["job_id"].removeprefix("local-")) for n, w in st.get("workers", {}).items()
            if w["job_id"].startswith("local-") and w.get("state") != "GONE" and w.get("phase") != "gone"
            and (role is None or roles.get(w["partition"]) == role) and (phase is None or w.get("phase") == phase)}


def engine_pids(st: dict[str, Any]) -> list[tuple[str, int]]:
    """``(node, pid)`` of every engine process the data layer's node table reports."""
    nodes = st.get("data_layer", {}).get("nodes", {})
    return [(n, int(pid)) for n, info in nodes.items() if not info.get("draining")
            for pid in (info.get("engine_pids") or {}).values()]


@dataclass
class Kill:
    """One kill: what, when (seconds since the chaos run started), at which trainer version,
    and whether (and how many seconds later) its part was back."""

    kind: str
    at_s: float
    version: int
    target: str
    pid: int
    recovered: bool = False
    recovery_s: float | None = None
    note: str = ""
    before: dict[str, Any] = field(default_factory=dict, repr=False)


class Killer:
    """Runs the kills against ``run`` (already started). ``kills``: how many; ``seed``: the
    random stream of kinds, targets and gaps; ``mean_gap_s``: mean of the exponential gap after
    a recovery; ``spare_steps``: no kill once the trainer is that close to ``run.max_steps``."""

    def __init__(self, run: CliRun, *, kills: int, seed: int, mean_gap_s: float = 5.0,
                 recovery_timeout_s: float = 300.0, spare_steps: int = 5, kinds: tuple[str, ...] = KINDS,
                 say: Callable[[str], None] | None = None):
        self.run, self.kills, self.mean_gap_s = run, kills, mean_gap_s
        self.recovery_timeout_s, self.spare_steps = recovery_timeout_s, spare_steps
        self.rng = random.Random(seed)
        self.kinds = kinds
        self.say = say or (lambda line: print(line, flush=True))
        self.done: list[Kill] = []
        self.skipped: list[str] = []
        #: processes of the killed incarnation alive once the resumed one recorded itself
        self.orphans: dict[str, int] = {"workers": 0, "engines": 0}
        self.t0 = time.time()

    # -- the plan ---------------------------------------------------------------------------
    def plan(self, engines_are_processes: bool) -> list[str]:
        """The kinds in kill order: one orchestrator kill (in the middle third, so node kills
        spread over both incarnations), the rest shared evenly, in a seeded order."""
        kinds = [k for k in self.kinds if k != "orchestrator" and (k != "engine" or engines_are_processes)]
        if "engine" in self.kinds and not engines_are_processes:
            self.skipped.append("engine: the config runs engines in the worker process "
                                "(rollout.engine.process: false), so there is no engine process to kill")
        n_orch = 1 if "orchestrator" in self.kinds and self.kills >= 2 else 0
        rest = [kinds[i % len(kinds)] for i in range(self.kills - n_orch)] if kinds else []
        self.rng.shuffle(rest)
        if n_orch:
            lo = len(rest) // 3
            rest.insert(self.rng.randint(lo, max(lo, len(rest) - lo)), "orchestrator")
        return rest

    # -- reading the run --------------------------------------------------------------------
    def _status(self, since: float = 0.0) -> dict[str, Any] | None:
        st = self.run.status()
        return st if st is not None and st.get("written_at", 0) >= since else None

    @staticmethod
    def _version(st: dict[str, Any]) -> int:
        return min((t.get("version", 0) for t in st.get("trainers", {}).values()), default=0)

    @staticmethod
    def _counts(st: dict[str, Any]) -> dict[str, int]:
        return {"trainer": sum(r.get("count", 0) for r in st.get("trainer_restarts", {}).values()),
                "data": st.get("data_layer_restarts", {}).get("count", 0)}

    def _rollout_ok(self, st: dict[str, Any]) -> bool:
        """Every rollout partition has all its nodes serving."""
        parts = [p for p in st.get("partitions", {}).values() if p.get("role") == "rollout"]
        return all(p.get("serving", 0) >= p.get("nodes", 0) for p in parts)

    def _node_kill_allowed(self, st: dict[str, Any]) -> bool:
        """One more node failure keeps every rollout partition below its crash-loop limit."""
        parts = [p for p in st.get("partitions", {}).values() if p.get("role") == "rollout"]
        return all(p.get("state") == "active" and p.get("failures", 0) + 1 < FAILURES_PER_NODE * max(p.get("nodes", 1), 1)
                   for p in parts)

    def _target(self, kind: str, st: dict[str, Any]) -> tuple[str, tuple[int, int]] | None:
        """What to kill for ``kind`` now (a worker name, or the CLI's, and a process identity),
        or None."""
        if kind == "orchestrator":
            ident = proc_identity(self.run.proc.pid)
            return ("astraflow run", ident) if ident else None
        if kind == "engine":
            nodes = worker_pids(st, "rollout", "serving")
            cands = [(n, pid) for n, pid in engine_pids(st) if n in nodes
                     and parent_of(pid) == nodes[n]]  # the engine is a child of that node's worker
        else:
            if kind == "node" and not self._node_kill_allowed(st):
                return None
            role = {"node": "rollout", "trainer": "trainer", "data": "data"}[kind]
            cands = sorted(worker_pids(st, role, "serving").items())
        cands = [(n, ident) for n, pid in sorted(cands) if (ident := proc_identity(pid))]
        return self.rng.choice(cands) if cands else None

    @staticmethod
    def _node_report(st: dict[str, Any], node: str) -> dict[str, Any]:
        return st.get("data_layer", {}).get("nodes", {}).get(node, {})

    # -- recovery ---------------------------------------------------------------------------
    def _recovered(self, k: Kill, st: dict[str, Any]) -> bool:
        if self._version(st) <= k.version:
            return False
        if k.kind == "node":
            return k.target not in worker_pids(st) and self._rollout_ok(st)
        if k.kind == "engine":
            return self._engine_back(k, st)
        if k.kind in ("trainer", "data"):
            return self._counts(st)[k.kind] > k.before[k.kind]
        return True  # the orchestrator: a status of the resumed incarnation (read since the resume)

    def _engine_back(self, k: Kill, st: dict[str, Any]) -> bool:
        """The node restarted its engine (its count of restarts grew, its engine PID changed)
        and completed episodes after that: a new PID alone shows a process that may still be
        loading. Or the node was replaced after all, and its successor serves."""
        if k.target not in worker_pids(st, "rollout", "serving"):
            if k.target not in worker_pids(st) and self._rollout_ok(st) and "replaced" not in k.note:
                k.note += "; its node was replaced instead"
            return k.target not in worker_pids(st) and self._rollout_ok(st)
        info = self._node_report(st, k.target)
        if info.get("engine_restarts", 0) <= k.before["engine_restarts"] or k.pid in (info.get("engine_pids") or {}).values():
            return False
        if k.before.get("episodes_then") is None:  # the restart has begun: episodes from here on are the new engine's
            k.before["episodes_then"] = info.get("episodes", 0)
            return False
        return info.get("episodes", 0) > k.before["episodes_then"] and self._rollout_ok(st)

    def _wait_recovery(self, k: Kill, since: float) -> None:
        deadline = time.time() + self.recovery_timeout_s
        while time.time() < deadline:
            st = self._status(since)
            if st is not None and self._recovered(k, st):
                k.recovered, k.recovery_s = True, time.time() - self.t0 - k.at_s
                return
            rc = self.run.proc.poll()
            if rc is not None:  # the run ended while its part was coming back
                summary = json.loads(self.run.paths.summary.read_text()) if self.run.paths.summary.exists() else {}
                k.recovered = rc == 0 and summary.get("status") == "completed"
                k.recovery_s = time.time() - self.t0 - k.at_s if k.recovered else None
                k.note += f"; the run ended (exit {rc}, {summary.get('status')}: {summary.get('reason')})"
                return
            time.sleep(0.5)
        k.note += f"; not back within {self.recovery_timeout_s:.0f}s"

    # -- killing ----------------------------------------------------------------------------
    def _kill_orchestrator(self, k: Kill, ident: tuple[int, int], st: dict[str, Any]) -> float:
        """SIGKILL the CLI, run it again (the resume), count what the dead incarnation left
        once the resumed one recorded itself, then kill that by PID. Returns when it resumed."""
        workers = [i for i in map(proc_identity, worker_pids(st).values()) if i]
        engines = [i for i in (proc_identity(pid) for _, pid in engine_pids(st)) if i]
        sigkill(ident)
        self.run.proc.wait(60)
        resumed_at = time.time()
        new = self.run.start()
        deadline = resumed_at + self.recovery_timeout_s
        while self.run.orchestrator_pid() != new.pid and new.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        left = {"workers": [i for i in workers if alive(i)], "engines": [i for i in engines if alive(i)]}
        grace = time.time() + EXIT_GRACE_S  # an engine killed with its worker may still be tearing down
        while any(left.values()) and time.time() < grace:
            time.sleep(0.1)
            left = {what: [i for i in idents if alive(i)] for what, idents in left.items()}
        for what, idents in left.items():
            self.orphans[what] += len(idents)
        for i in left["workers"] + left["engines"]:
            sigkill(i)
        k.note = (f"resumed as pid {new.pid}; left by the killed incarnation when it resumed: "
                  f"{len(left['workers'])} worker(s), {len(left['engines'])} engine(s)")
        return resumed_at

    def unplanned_losses(self) -> list[str]:
        """Workers the run lost that this killer did not kill (a node replaced after an error,
        say): each is a part that failed on its own during the chaos."""
        killed = {k.pid for k in self.done}
        return [f"{name}: {why}" for pid, (name, why) in sorted(self.run.losses.items()) if pid not in killed]

    def run_all(self) -> list[Kill]:
        """Kill ``kills`` times (or until the run nears its end, ends, or a part does not come
        back); returns the kills."""
        st = None
        while st is None or self._version(st) < 1:  # training has begun
            if self.run.proc.poll() is not None:
                return self.done
            time.sleep(0.5)
            st = self._status()
        engines_are_processes = bool(self.run.config()["rollout"]["engine"].get("process", False))
        plan = self.plan(engines_are_processes)
        max_steps = int(self.run.config()["run"]["max_steps"])
        while plan:
            time.sleep(min(self.rng.expovariate(1.0 / self.mean_gap_s), 4 * self.mean_gap_s))
            st = self._status()
            if self.run.proc.poll() is not None or st is None:
                break
            if self._version(st) >= max_steps - self.spare_steps:
                self.skipped.append(f"{len(plan)} kill(s) not done: the run reached step {self._version(st)} "
                                    f"of {max_steps} (the last {self.spare_steps} are left to finish)")
                break
            order = plan + [x for x in self.kinds if x not in ("orchestrator", *plan)
                            and (x != "engine" or engines_are_processes)]
            choice = next(((kind, t) for kind in order if (t := self._target(kind, st))), None)
            if choice is None:
                continue  # nothing killable right now (e.g. a node still starting): wait another gap
            kind, (target, ident) = choice
            if kind in plan:
                plan.remove(kind)
            else:  # the planned kinds cannot be killed now (the crash-loop limit): another instead
                plan.pop(0)
            k = Kill(kind, time.time() - self.t0, self._version(st), target, ident[0], before=self._counts(st))
            if kind == "engine":
                k.before["engine_restarts"] = self._node_report(st, target).get("engine_restarts", 0)
            self.done.append(k)
            what = f"engine of {target}" if kind == "engine" else target
            self.say(f"[{k.at_s:6.0f}s] kill {len(self.done)}/{self.kills}: {kind} {what} (pid {ident[0]}) "
                     f"at v{k.version}")
            since = time.time()
            if kind == "orchestrator":
                since = self._kill_orchestrator(k, ident, st)
            else:
                sigkill(ident)
            self._wait_recovery(k, since)
            self.say(f"[{time.time() - self.t0:6.0f}s]   {'recovered' if k.recovered else 'NOT recovered'}"
                     + (f" in {k.recovery_s:.1f}s" if k.recovery_s is not None else "") + (f" {k.note}" if k.note else ""))
            if not k.recovered:
                break
        return self.done
