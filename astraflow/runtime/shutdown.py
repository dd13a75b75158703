"""How a run ends (the orchestrator's ``Shutdown`` side): the components stopped in order,
each wait bounded, ``summary.json`` written with the ending; then every worker job still
alive cancelled by id and the Dask scheduler stopped by pid."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from astraflow.runtime.progress import failures_outnumber_consumed
from astraflow.runtime.stopping import BoundedWaits, Ending, is_failing_tasks_reason
from astraflow.runtime.workers import NODE_PHASES
from storage.atomic import write_json
from storage.weights import WeightStore

log = logging.getLogger("astraflow.runtime")


@dataclass
class RunResult:
    run_dir: Path
    steps: dict[str, int]
    eval: list[dict[str, Any]]
    ledger: dict[str, Any]
    seconds: float
    interrupted: bool = False
    nodes: dict[str, Any] = field(default_factory=dict)
    ending: Ending = Ending("completed")


def jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` with what JSON cannot hold turned into strings: keys that are not strings or
    numbers, sets and tuples made lists, other objects (and anything nested too deep: a cycle)
    their ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 64:
        return str(value)
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else str(k): jsonable(v, depth + 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v, depth + 1) for v in value]
    return str(value)


def committed_steps(weights: Path, policies: list[str], reported: dict[str, int]) -> dict[str, int]:
    """Per policy, the newest version committed in the weight store at ``weights`` (what a
    resume starts from): a trainer lost after the last tick, or between a commit and its report,
    committed more than it said. What it (or the last tick) reported, ``reported``, where the
    store holds none of it or cannot be listed."""
    store = WeightStore(weights)
    steps = {}
    for p in policies:
        try:
            kept = store.versions(p)
        except OSError as err:  # an unreadable store: the summary is still written
            log.warning("listing the committed versions of %s failed: %s: %s", p, type(err).__name__, err)
            kept = []
        if kept:
            steps[p] = kept[-1]
        elif p in reported:
            steps[p] = reported[p]
    return steps


@dataclass(frozen=True)
class StopBudgets:
    """Seconds each part of a stop may take. A run that completed stops at leisure (fixed
    bounds); after a failure or a signal the whole stop keeps to ``cluster.stop_grace_s``: the
    nodes share 0.4 of it (plus 0.1 for their answers: engines closed, the reply sent; engines
    that close slowly, as vLLM's core processes, want a larger grace), the trainers 0.3, so that
    the data layer can still close the ledger."""

    total: float
    node: float
    node_answer: float
    trainer: float

    @classmethod
    def for_ending(cls, ending: Ending, grace: float) -> "StopBudgets":
        if ending.clean:
            return cls(total=600.0, node=60.0, node_answer=10.0, trainer=120.0)
        return cls(total=grace, node=0.4 * grace, node_answer=0.1 * grace, trainer=0.3 * grace)


class Shutdown:
    """The orchestrator's way out: ``_shutdown`` then ``_teardown`` (``Orchestrator.run``)."""

    def _shutdown(self, t0: float, ending: Ending) -> RunResult:
        """Stop the components in order and write ``summary.json`` with ``ending``. Every wait
        is bounded (`BoundedWaits`, by `StopBudgets`). What a component that is gone would have
        said comes from the last tick; what did not answer is listed as ``stop_errors``."""
        # the stop may take minutes (a completed run's nodes flush, vLLM engines close): the last status
        # is written on, naming it, so that `status` says the run is stopping, not that it went silent
        with self.status.alive_while(f"stopping: the run {ending.status}"
                                     + (f" ({ending.reason})" if ending.reason else "")):
            return self._stop_components(t0, ending)

    def _stop_components(self, t0: float, ending: Ending) -> RunResult:
        budgets = StopBudgets.for_ending(ending, self.cfg.cluster.stop_grace_s)
        waits = BoundedWaits(budgets.total)
        nodes: dict[str, Any] = {}
        trainers: dict[str, Any] = {}
        ledger: dict[str, Any] = {}
        state: dict[str, Any] = {}
        if self.dl is not None:
            nodes = self._stop_nodes(waits, budgets)
            stops = {p: waits.start(f"trainer {p}", lambda t=t: t.stop(timeout=budgets.trainer))
                     for p, t in self.trainers.items()}
            trainers = {p: waits.result(f"trainer {p}", f, budgets.trainer + 30) for p, f in stops.items()}
            # a run stopped before its end keeps its served, uncommitted batches for the resume
            ledger = waits.call("data layer finish", lambda: self.dl.finish(completed=ending.clean), 60) or {}
            state = waits.call("data layer state", lambda: self.dl.state(), 30) or {}
            waits.call("data layer close", lambda: self.dl.close(), 30)
        last = self.last_tick
        if not state and last is not None:  # the data layer did not answer: its last tick
            state = dict(last.data_layer)
        if state:  # every evaluation the run recorded: a tick carries the newest only, and a data layer
            # that is not durable resumes without its previous incarnations'
            state = {**state, "eval": all_evals(state.get("eval", []), evals_on_record(self.paths.metrics))}
        trainers = {p: t or (last.trainers.get(p) if last else None) for p, t in trainers.items()}
        steps = committed_steps(self.paths.weights, list(trainers), {p: t["version"] for p, t in trainers.items() if t})
        result = RunResult(self.paths.root, steps, state.get("eval", []), ledger or state.get("ledger", {}),
                           time.time() - t0, ending.status == "interrupted", nodes, ending)
        self._warn_failures(result.ledger, ending)
        self._write_summary(ending, dict(steps=steps, ledger=result.ledger, ledger_closed=bool(ledger),
                                         seconds=result.seconds, nodes=nodes, trainers=trainers, data_layer=state,
                                         iterations=self.iterations, stop_errors=waits.errors))
        return result

    def _stop_nodes(self, waits: BoundedWaits, budgets: StopBudgets) -> dict[str, Any]:
        """Every serving node stopped at once (a draining one's drain is its stop), their answers
        by node. A node still loading its model is not waited for (`_still_starting`: its job is
        cancelled with the others, it holds no lease yet); with the data layer lost nothing a
        node flushes could be completed, so none is waited for. A node that did not answer:
        its leases end as run_ended."""
        dl_lost = any(w.gone for w in self.fleet.of_role("data"))
        live = [w for w in self.fleet.of_role("rollout")
                if w.phase in NODE_PHASES and w.actor is not None and not dl_lost]
        stops = {w.name: (w.future if w.draining else waits.start(f"node {w.name}",
                                                                  lambda w=w: w.actor.stop(timeout=budgets.node)))
                 for w in live if not _still_starting(w)}
        nodes = {}
        for n, answer in _answers(waits, "node", stops, budgets.node + budgets.node_answer).items():
            nodes[n] = answer or {"node": n, "error": waits.errors.get(f"node {n}")}
        for w in live:
            if _still_starting(w):
                nodes[w.name] = {"node": w.name, "stopped": False, "error": None,
                                 "note": "still starting (its model loading): not waited for"}
        return nodes

    def _warn_failures(self, ledger: dict[str, Any], ending: Ending) -> None:
        """Warn, once, when more rollout tasks failed than were trained on (a run can end on the few
        episodes that did not fail): as a progress note, or in the log when there is no progress
        output (``--quiet``). Not for a run that fails for its failing tasks: its line says so."""
        warning = failures_outnumber_consumed(ledger, self.paths.jobs)
        if not warning or (ending.status == "failed" and is_failing_tasks_reason(ending.reason)):
            return
        progress = getattr(self, "progress", None)
        if progress is not None and progress.enabled:
            progress.note(f"[bold]warning[/bold]: {escape(warning)}", markup=True)
        else:
            log.warning("%s", warning)

    def _write_summary(self, ending: Ending, parts: dict[str, Any]) -> None:
        """``summary.json`` is written whatever the parts hold: a value JSON cannot hold (a user
        rule's state with tuple keys, say) is written as a string, and the ending's reason kept."""
        try:
            self.status.write_summary(ending=ending, **parts)
            return
        except (TypeError, ValueError) as err:
            log.warning("summary.json holds values JSON cannot hold (%s: %s): they are written as strings",
                        type(err).__name__, err)
        try:
            self.status.write_summary(ending=ending, **{k: jsonable(v) for k, v in parts.items()})
        except (TypeError, ValueError) as err:  # what the status adds itself: the ending and the steps at least
            log.warning("summary.json could not be written in full (%s: %s): only the ending and the steps are",
                        type(err).__name__, err)
            write_json(self.paths.summary, jsonable({
                "status": ending.status, "reason": ending.reason, "requeue": ending.requeue,
                "steps": parts.get("steps", {}), "interrupted": ending.status == "interrupted",
                "summary_error": f"{type(err).__name__}: {err}"}), indent=2)

    def _gone_but_listed(self, sched: Any) -> list[str]:
        """Jobs of workers that left the Dask scheduler (a hung trainer, say) whose scheduler
        still lists them active: they would hold their nodes after the run."""
        gone = {w.job.job_id for w in self.workers.values() if w.job.kind == sched.kind and w.gone}
        if not gone:
            return []
        try:
            return [j.job_id for j in sched.jobs() if j.job_id in gone and j.active]
        except Exception as err:  # the listing failed: those jobs are left as they are, said in the log
            log.warning("listing the %s jobs of lost workers failed: %s: %s", sched.kind, type(err).__name__, err)
            return []

    def _teardown(self) -> None:
        """Cancel every worker job still alive (by id) and stop the scheduler (by pid). Each step
        is tried even when one before failed; a failure is logged (a job may be left running)."""
        steps: list[tuple[str, Any]] = []
        if self.placement.client is not None:
            steps.append(("closing the Dask client", self.placement.client.close))
        for sched in self.parts.schedulers.values():
            alive = [w.job.job_id for w in self.workers.values() if w.job.kind == sched.kind and not w.gone]
            alive += self._gone_but_listed(sched)
            alive += [j for j in self.parts.uncancelled(sched.kind) if j not in alive]
            steps += [(f"cancelling the {sched.kind} jobs {alive}", lambda s=sched, a=alive: s.cancel(a)),
                      (f"closing the {sched.kind} scheduler", sched.close)]
        if self.parts.fork_server is not None:  # closed with the local scheduler, unless none was made
            steps.append(("closing the fork server", self.parts.fork_server.close))
        if self.placement.scheduler_proc is not None:
            steps.append(("stopping the Dask scheduler", self.placement.scheduler_proc.stop))
        for what, step in steps:
            try:
                step()
            except Exception as err:  # the next step still runs: no job or process left behind for this one
                log.warning("%s failed: %s: %s", what, type(err).__name__, err)


def evals_on_record(metrics: Path) -> list[dict[str, Any]]:
    """The evaluation lines of ``metrics.jsonl``, in order, the last of each policy and version
    (a version trained again after a lost data layer is recorded again)."""
    from astraflow.runtime.monitoring.metrics import is_eval_record, tail_records

    try:
        records, _ = tail_records(metrics, 0)
    except OSError:
        return []
    kept = {(r.get("policy"), r["step"]): r for r in records if is_eval_record(r)}
    return sorted(kept.values(), key=lambda r: r["step"])


def all_evals(answered: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluations the data layer ``answered`` with and those ``metrics.jsonl`` ``recorded``
    (`evals_on_record`), once each by policy and version (the record's when both have one), in
    the order of their versions."""
    kept = {(r.get("policy"), r.get("step")): r for r in answered}
    kept.update({(r.get("policy"), r["step"]): r for r in recorded})
    return sorted(kept.values(), key=lambda r: r.get("step", 0))


def _still_starting(w: Any) -> bool:
    """Whether the RaaS node on worker ``w`` is still in its ``start()`` (loading its model):
    a stop sent to it would wait behind that on the worker's actor thread, and it holds no
    lease until ``start()`` returns."""
    return w.phase in ("placing", "starting") and w.future is not None and not w.future.done()


def _answers(waits: BoundedWaits, kind: str, futures: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The answers of calls made at once (``{name: future}``, ``kind`` naming them in the
    errors), waited for together: they share one deadline ``seconds`` from now (and ``waits``'
    own). One still unanswered after it is noted as timed out without a further wait (the least
    wait ``waits`` gives each call would add up over many)."""
    deadline = time.monotonic() + seconds
    out: dict[str, Any] = {}
    for name, future in futures.items():
        what = f"{kind} {name}"
        if future is not None and time.monotonic() >= deadline and not future.done():
            waits.errors[what] = f"TimeoutError: no answer within {seconds:.1f} s (the {kind}s' share of the stop)"
            log.info("stopping the run: %s: %s", what, waits.errors[what])  # reported in summary.json
            out[name] = None
            continue
        out[name] = waits.result(what, future, max(deadline - time.monotonic(), 0.0))
    return out
