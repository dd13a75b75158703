"""Runtime room: how a run ended, and waits that cannot hang the way out.

Every ending of a run (its last step, Ctrl-C or SIGTERM, the requeue signal, a lost data-layer worker, a lost
trainer worker past its restarts, the run deadline, an actor call that raised) leaves through the same path in the
orchestrator: stop the components, write ``summary.json`` with the `Ending`, cancel the worker jobs. On that
path a component may already be gone, so every actor call is made through `BoundedWaits`: all
of them share one deadline, and a call that raises or does not answer is noted, never raised.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from storage.full_disk import is_full_disk

log = logging.getLogger("astraflow.runtime")


#: the signal that stops a run *to be resumed*: a Slurm head job gets it before its walltime
#: (``#SBATCH --signal=B:USR1@...``, forwarded to the run by jobs/astraflow-head.sbatch)
REQUEUE_SIGNAL = signal.SIGUSR1

#: what ``astraflow run`` exits with after it stopped on `REQUEUE_SIGNAL` (``EX_TEMPFAIL``: try
#: again later); the head job requeues itself on it and on nothing else
REQUEUE_EXIT_CODE = 75


#: set once a run is on its way out (its stop under way, however it ended): a stop signal then
#: only says so, it must not break the shutdown that writes the summary and cancels the jobs
STOPPING = threading.Event()


def ignore_stop_signals() -> None:
    """After a stopped run has written its summary: further Ctrl-C, SIGTERM, SIGUSR1 or SIGHUP are
    ignored while the process exits. Python restores the default action of a signal with a
    handler of its own late in its exit, and a signal arriving then would kill the process and
    lose the exit code (130 or 75) that tells the shell or the head job how the run ended."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, REQUEUE_SIGNAL, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)


class StopForRequeue(KeyboardInterrupt):
    """Raised in the main thread by `REQUEUE_SIGNAL`: the run stops the way Ctrl-C stops it
    (nodes flush, trainers commit, summary, jobs cancelled), marked to be resumed."""


@dataclass(frozen=True)
class Ending:
    """How a run ended; written into ``summary.json`` as ``status``, ``reason`` and ``requeue``."""

    status: str
    """``completed`` (every trainer took its steps), ``interrupted`` (Ctrl-C, SIGTERM, scancel,
    the requeue signal) or ``failed``."""
    reason: str | None = None
    """Why it was interrupted or failed, in one line; None for a completed run."""
    requeue: bool = False
    """True when it stopped to be resumed (`StopForRequeue`, or its Dask scheduler was lost): the
    head job requeues."""

    @property
    def clean(self) -> bool:
        return self.status == "completed"


def interrupted(sig: KeyboardInterrupt) -> Ending:
    """The `Ending` of a run stopped by Ctrl-C, SIGTERM or the requeue signal."""
    by = f"stopped by {sig.args[0] if sig.args else 'Ctrl-C'}"
    if isinstance(sig, StopForRequeue):
        return Ending("interrupted", f"{by} for a requeue (the warning before the walltime)", requeue=True)
    return Ending("interrupted", by)


def disk_full(err: BaseException) -> bool:
    """Whether `err` is a write refused for want of room: the filesystem full, the user's quota
    exceeded, or a file past the file-size limit (``storage.full_disk``); or refused by a
    filesystem made read-only (remounted, or by the kernel after an I/O error). Either way no
    write of the run can land, a new worker would meet it too, and the directory resumes once
    it takes writes again."""
    return is_full_disk(err) or (isinstance(err, OSError) and err.errno == errno.EROFS)


def full_disk_of(report: dict[str, Any]) -> OSError | None:
    """The full-disk ``OSError`` a component's report (a trainer's state, a node's heartbeat)
    carries in ``error_os`` (errno, filename), rebuilt: its error crossed the actor boundary as a
    string, and a run whose disk is full ends the one way any full disk ends it. None otherwise."""
    if not report.get("error_os"):
        return None
    code, filename = report["error_os"]
    err = OSError(code, os.strerror(code), filename)
    return err if disk_full(err) else None


#: how each of ``disk_full_reason``'s lines begins
_FULL_DISK_OPENINGS = ("no space left", "quota exceeded", "file-size limit reached", "read-only filesystem")


def is_disk_full_reason(reason: str | None) -> bool:
    """Whether ``reason`` is a line ``disk_full_reason`` wrote (it is not repeated after a second one)."""
    return bool(reason) and reason.startswith(_FULL_DISK_OPENINGS)


def disk_full_reason(err: OSError, run_dir: Path) -> str:
    """One line for a run stopped by a full disk, a quota or a file-size limit: what could not be
    written, and the way on (every write of a run is atomic or committed by a marker, so the
    directory resumes)."""
    what = f"writing {err.filename}" if err.filename else "a write"
    outside = err.filename and not Path(os.path.abspath(err.filename)).is_relative_to(Path(run_dir).absolute())
    # a disk of its own (a node's scratch, a trajectory store elsewhere): that one is full
    where, resume = (err.filename, f"on {run_dir}") if outside else (run_dir, "on this directory")
    if err.errno == errno.EDQUOT:  # the filesystem may have room: the user's share of it is spent
        return (f"quota exceeded on {where} ({what} failed): check your quota (e.g. `quota -s`, or `lfs quota -u "
                f"$USER <mount>` on Lustre) and free space within it or have it raised, then run `astraflow run` "
                f"again {resume} to resume")
    if err.errno == errno.EROFS:  # not for want of room: the filesystem takes no writes at all
        return (f"read-only filesystem at {where} ({what} failed): make it writable again (remount it "
                "read-write; one the kernel made read-only after an I/O error needs its administrator), "
                f"then run `astraflow run` again {resume} to resume")
    if err.errno == errno.EFBIG:  # a per-process limit, not the disk: Slurm jobs inherit the submit shell's
        return (f"file-size limit reached on {where} ({what} failed): a file outgrew `ulimit -f` (RLIMIT_FSIZE; "
                "Slurm passes the submitting shell's limits to its jobs) or the largest file the filesystem "
                f"takes: raise the limit (`ulimit -f unlimited` before submitting), then run `astraflow run` "
                f"again {resume} to resume")
    if outside:
        return (f"no space left on the filesystem of {where} ({what} failed): free space there, then run "
                f"`astraflow run` again {resume} to resume")
    return (f"no space left on the filesystem of {run_dir} ({what} failed): free space there (or move the run "
            "directory to a larger filesystem), then run `astraflow run` again on this directory to resume")


class BoundedWaits:
    """Actor calls that share one deadline, ``seconds`` from now. A call that raises (an actor's
    error comes back as whatever type it raised; a lost worker's as ``RuntimeError``) or that
    does not answer in time is noted in ``errors`` and gives None."""

    #: the least time a call is given once the deadline has passed (a live actor answers in it)
    FLOOR_S = 0.5

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.errors: dict[str, str] = {}

    def left(self, cap: float) -> float:
        """Seconds the next wait may take: ``cap``, or less when the deadline is nearer."""
        return max(min(cap, self.deadline - time.monotonic()), self.FLOOR_S)

    def start(self, what: str, make_call: Callable[[], Any]) -> Any:
        """``make_call()``: start an actor call and return its future (None if even that fails:
        the handle of an actor whose worker was lost raises at once)."""
        try:
            return make_call()
        except Exception as err:  # whatever the handle raises, the way out goes on
            self._note(what, err)
            return None

    def result(self, what: str, future: Any, cap: float) -> Any:
        """The result of ``future`` within ``left(cap)`` seconds, or None."""
        if future is None:
            return None
        try:
            return future.result(timeout=self.left(cap))
        except Exception as err:  # an actor's own error, a lost worker, a timeout: noted, not raised
            self._note(what, err)
            return None

    def call(self, what: str, make_call: Callable[[], Any], cap: float) -> Any:
        return self.result(what, self.start(what, make_call), cap)

    def _note(self, what: str, err: Exception) -> None:
        self.errors[what] = f"{type(err).__name__}: {err}".strip()
        log.info("stopping the run: %s: %s", what, self.errors[what])  # reported in summary.json


#: tasks dropped untrained since the last trained batch, per failed task of
#: ``NothingCompletes.limit``, that stop a run: a healthy run whose group filter drops most of
#: its groups still trains a batch well within it
DROPPED_PER_FAILED = 4

#: what to do about tasks dropped for a reason (the ``Ledger``'s drop reasons)
_DROP_FIXES = {
    "zero_advantage": "every episode of a group got the same reward, so there is nothing to learn from: look at "
                      "the rewards in the episode viewer (all 0: the task is too hard for the model or its reward "
                      "never pays; a warm start or easier tasks help)",
    "group_incomplete": "too few episodes of each group completed (see why the others failed)",
    "stale": "the trainer falls too far behind the rollouts (dataflow.max_staleness)",
}


def _top(recent: dict[str, int]) -> str:
    reasons = sorted(((why, c) for why, c in recent.items() if c > 0), key=lambda kv: -kv[1])[:3]
    return "; ".join(f"{count}x {why}" for why, count in reasons) or "no reason recorded"


class NothingCompletes:
    """A run in which tasks keep failing and none completes (an engine that cannot take the
    prompts, or whose weights went bad after some steps; a reward that always raises) is stopped
    with the failures' reasons instead of creating new tasks until ``run.timeout_s``. Counts the
    failures since the last completion seen (from the first tick this object sees: a resumed
    run's earlier tasks do not count).

    Completing is not training: a run whose tasks all complete and are then dropped (every
    group filtered for equal rewards, or too few episodes of each group completing) trains
    nothing either. The tasks dropped since the last one trained on or kept are counted too, and
    ``dropped_limit`` of them stop the run naming the drop reasons.

    A task is consumed when any policy trains on it, so with several policies the ledger does not
    see one policy starved while another trains (a group filter that drops only its groups):
    ``check_layer`` also counts, per policy whose trainer has steps left, every policy's routed
    sequences since it last kept or trained on one of its own (the data layer's per-policy
    counts), and the curator's skips since the last group was made (a curator that accepts
    nothing makes no task to fail or drop)."""

    def __init__(self, limit: int, dropped_limit: int | None = None, max_steps: int | None = None,
                 group_filter: str = "keep_all", curator: str = "accept_all"):
        self.limit = limit
        self.dropped_limit = dropped_limit or DROPPED_PER_FAILED * limit
        self.max_steps, self.group_filter, self.curator = max_steps, group_filter, curator
        #: (prompts the curator skipped, groups made) when a group was last made
        self._made: tuple[int, int] | None = None
        #: per policy: its counts at the last sequence it kept or trained on
        self._policy_base: dict[str, dict[str, int]] = {}
        self._base: tuple[int, int] | None = None
        self._reasons_base: dict[str, int] = {}
        #: (dropped, consumed, failed) at the last consumption seen, and the reasons then
        self._trained: tuple[int, int, int] | None = None
        self._trained_reasons: dict[str, int] = {}
        self._kept = 0  # groups kept for a batch (the ledger's event) at the last reset

    @classmethod
    def of_run(cls, cfg: Any, limit: int) -> "NothingCompletes":
        """The watch of a run: ``limit`` failures, at least four batches' worth."""
        return cls(max(limit, 4 * cfg.dataflow.batch_size), max_steps=cfg.run.max_steps,
                   group_filter=cfg.dataflow.group_filter.type, curator=cfg.dataflow.curator.type)

    def check(self, ledger: dict[str, Any]) -> str | None:
        """Why the run must stop (``ledger``: the data layer's ``Ledger.summary()``), or None."""
        return self._failing(ledger) or self._untrained(ledger)

    def check_layer(self, layer: dict[str, Any]) -> str | None:
        """``check`` of the data layer's status ``layer`` (``DataLayer.state``), then each policy's."""
        return self.check(layer.get("ledger", {})) or self._starved(layer) or self._all_skipped(layer)

    def _all_skipped(self, layer: dict[str, Any]) -> str | None:
        """A curator that accepts no prompt any more: no group is made, so nothing fails or is
        dropped either; its skips since the last group made stop the run."""
        counts, sources = layer.get("counts") or {}, layer.get("sources") or {}
        skipped = sum(int(c.get("curator_skipped", 0)) for c in counts.values())  # counted on the first policy
        made = sum(int(s.get("groups_created", 0)) for s in sources.values() if isinstance(s, dict))
        if self._made is None or made > self._made[1]:
            self._made = (skipped, made)
            return None
        n = skipped - self._made[0]
        if n < self.dropped_limit:
            return None
        return (f"the curator (dataflow.curator: {self.curator}) skipped {n} prompts in a row and accepted none "
                f"since the last group was made ({made} in all): loosen it (e.g. its explore), or set "
                "dataflow.curator: accept_all, then run again on this run directory")

    def _starved(self, layer: dict[str, Any]) -> str | None:
        versions, counts = layer.get("versions") or {}, layer.get("counts") or {}
        routed = sum(int(c.get("sequences_ingested", 0)) for c in counts.values())  # every policy's
        for policy, c in counts.items():
            if self.max_steps is not None and int(versions.get(policy, 0)) >= self.max_steps:
                continue  # its trainer is done: what it no longer takes is not starving it
            now = {k: int(c.get(k, 0)) for k in ("sequences_ingested", "accepted", "consumed", "filtered",
                                                  "stale_dropped", "overflow_dropped")}
            now["routed"] = routed
            base = self._policy_base.get(policy)
            if base is None or now["accepted"] > base["accepted"] or now["consumed"] > base["consumed"]:
                self._policy_base[policy] = now
                continue
            n = routed - base["routed"]  # a policy the episodes give no tokens is starved as well
            if n < self.dropped_limit:
                continue
            since = "since it last kept one" if now["accepted"] else "and it kept none"
            return (f"policy {policy} is starved: {n} rollout sequences were routed to the policies {since}: "
                    f"{self._drops(now, base)}; its trainer waits at v{int(versions.get(policy, 0))}: "
                    f"fix what drops them or gives it none, then run again on this run directory")
        return None

    def _failing(self, ledger: dict[str, Any]) -> str | None:
        events = ledger.get("events", {})
        failed, completed = int(events.get("failed", 0)), int(events.get("completed", 0))
        by_reason = dict(ledger.get("failed_by_reason", {}))
        if self._base is None or completed > self._base[1]:
            self._base, self._reasons_base = (failed, completed), by_reason
            return None
        n = failed - self._base[0]
        if n < self.limit:
            return None
        recent = {why: c - self._reasons_base.get(why, 0) for why, c in by_reason.items()}
        since = "since the last one completed" if completed else "and none completed"
        return (f"{n} rollout tasks failed {since} ({_top(recent)}): fix what the reasons say (a RaaS node's "
                "log under the run's jobs/ has the traceback), then run again on this run directory")

    def _drops(self, now: dict[str, int], base: dict[str, int]) -> str:
        """What became of a policy's sequences between its counts ``base`` and ``now``."""
        d = {k: now[k] - base[k] for k in now}
        if not d["sequences_ingested"]:
            return "none was for it (its episodes wrote no tokens of it: see the workflow)"
        parts = [f"{d['filtered']} by the group filter (dataflow.group_filter: {self.group_filter})"]
        parts += [f"{d['stale_dropped']} stale (dataflow.max_staleness)", f"{d['overflow_dropped']} overflow"]
        rest = d["sequences_ingested"] - d["filtered"] - d["stale_dropped"] - d["overflow_dropped"]
        parts.append(f"{rest} in groups of fewer than 2 of its sequences")
        dropped = "; ".join(p for p in parts if not p.startswith(("0 ", "-")))
        return f"{d['sequences_ingested']} were for it and dropped untrained ({dropped})"

    def _untrained(self, ledger: dict[str, Any]) -> str | None:
        events = ledger.get("events", {})
        dropped, consumed, failed, kept = (int(events.get(k, 0)) for k in ("dropped", "consumed", "failed", "kept"))
        by_reason = {f"dropped: {why}": int(c) for why, c in (ledger.get("dropped_by_reason") or {}).items()}
        by_reason.update({str(why): int(c) for why, c in (ledger.get("failed_by_reason") or {}).items()})
        # a task trained on, or a group kept (it has a signal, and waits for a batch: a run whose
        # filter drops most groups is slow, not stuck)
        if self._trained is None or consumed > self._trained[1] or kept > self._kept:
            self._trained, self._trained_reasons, self._kept = (dropped, consumed, failed), by_reason, kept
            return None
        n = dropped - self._trained[0]
        if n < self.dropped_limit:
            return None
        recent = {why: c - self._trained_reasons.get(why, 0) for why, c in by_reason.items()}
        fixes = [fix for why, fix in _DROP_FIXES.items() if recent.get(f"dropped: {why}", 0) * 4 >= n]
        also = f", {failed - self._trained[2]} failed" if failed > self._trained[2] else ""
        since = "since the last one was trained on" if consumed else "and none was trained on"
        return (f"{n} rollout tasks completed and were dropped untrained{also} {since} ({_top(recent)}): "
                + "".join(f"{fix}; " for fix in fixes) + "fix that, then run again on this run directory")


#: how `NothingCompletes.check`'s reason begins
_FAILING_TASKS = re.compile(r"\d+ rollout tasks failed (and none completed|since the last one completed) ")


def deadline_reason(cfg: Any, data_layer: dict[str, Any] | None) -> str:
    """The run's end at ``run.timeout_s``, with what held its batches back where the data layer's
    last status (``data_layer``) shows it: the curator or the group filter taking most of what
    could have been trained (a run whose deadline comes before ``trainer.batch_timeout_s``
    would otherwise end without the reason its trainers' timeouts give)."""
    from astraflow.dataflow.admission import rules_took

    why = f"run deadline of {cfg.run.timeout_s:.0f}s passed (run.timeout_s)"
    counts, sources = (data_layer or {}).get("counts") or {}, (data_layer or {}).get("sources") or {}
    first = cfg.policies[0].name
    made = sum(int(s.get("groups_created", 0)) for s in sources.values() if isinstance(s, dict))
    clauses = {rules_took(int(counts.get(first, {}).get("curator_skipped", 0)), made,
                          int(c.get("filtered", 0)), int(c.get("sequences_ingested", 0)),
                          cfg.dataflow.curator.type, cfg.dataflow.group_filter.type)
               for c in (counts.get(p.name) or {} for p in cfg.policies)}
    return why + "".join(sorted(c for c in clauses if c))


def is_failing_tasks_reason(reason: str | None) -> bool:
    """Whether ``reason`` is a line `NothingCompletes.check` wrote (its failures said already)."""
    return bool(reason) and _FAILING_TASKS.match(reason) is not None


def rule_failed(data_layer: dict) -> str | None:
    """The run's end when a dataflow rule failed in the data layer (its status says which): no
    node or trainer is to blame, and replacing them would only fail again."""
    why = data_layer.get("rule_error")
    return f"{why} (fix the rule, then run `astraflow run` again on this directory to resume)" if why else None
