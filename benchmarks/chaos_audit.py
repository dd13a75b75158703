"""The audit of a finished run directory: did the run lose or repeat anything?

Read only from what a run leaves behind, so it judges a run however it was interrupted and
resumed (``benchmarks/chaos.py`` and ``tests/e2e/test_chaos_cli.py`` use it):

* ``control/ledger.jsonl`` (one line per task created and per task ended, across incarnations):
  every task created once and ended exactly once; ``duplicated_trainings`` = tasks consumed
  more than once;
* the trajectory store (commit markers carry each entry's task id): ``lost_trajectories`` =
  tasks with a committed trajectory that never ended in the journal, or ended ``dropped`` as
  ``served_not_trained`` (served to a trainer, then neither trained on nor served again);
* ``metrics.jsonl``: parses line by line; per policy the training lines run 1, 2, ... N with no
  gap and no repeat (lines of versions a lost trainer committed without reporting are written
  at recovery, marked ``recovered``); evaluation steps strictly increase;
* the weight store: retention (``storage.keep_versions``) deletes old versions, so only the
  newest few stay; they must be committed, consecutive and end at the final step, with nothing
  half-published left behind. The full history of versions is the metrics' training lines:
  each committed version writes exactly one;
* ``summary.json``: the last incarnation's status is ``completed`` at ``run.max_steps``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from storage import paths as layout
from storage.paths import RunPaths
from storage.trajectories import open_trajectory_store
from storage.weights import WeightStore


def journal_counts(journal: Path) -> dict[str, Any]:
    """Per-task creation and end counts of ``ledger.jsonl``, and the end reasons."""
    created, ended, consumed = Counter(), Counter(), Counter()
    final: dict[str, tuple[str, str | None]] = {}
    bad = 0
    for line in journal.read_text(errors="replace").splitlines() if journal.exists() else []:
        try:
            rec = json.loads(line)
            task, event = rec["t"], rec["e"]
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        if event == "created":
            created[task] += 1
            continue
        ended[task] += 1
        final[task] = (event, rec.get("r"))
        if event == "consumed":
            consumed[task] += 1
    outcomes = Counter(e for e, _ in final.values())
    dropped = Counter(r or "unknown" for e, r in final.values() if e == "dropped")
    failed = Counter(r or "unknown" for e, r in final.values() if e == "failed")
    return {"created": created, "ended": ended, "consumed": consumed, "final": final, "bad_lines": bad,
            "outcomes": dict(outcomes), "dropped_by_reason": dict(dropped), "failed_by_reason": dict(failed)}


def committed_tasks(store_dir: Path) -> Counter:
    """Committed entries per task id, over every segment of the trajectory store."""
    per_task: Counter = Counter()
    if not store_dir.exists():  # no node ever wrote
        return per_task
    store = open_trajectory_store(str(store_dir), mode="r")
    for seg in store.segments():
        for seqno in range(store.batch_count(seg)):
            per_task.update(store.batch(seg, seqno).strings["task_id"])
    return per_task


def metrics_check(metrics: Path) -> dict[str, Any]:
    """Training steps and evaluations per policy from ``metrics.jsonl``, and what is wrong."""
    steps: dict[str, list[int]] = defaultdict(list)
    evals: dict[str, list[dict[str, Any]]] = defaultdict(list)
    recovered, bad = 0, 0
    for line in metrics.read_text(errors="replace").splitlines() if metrics.exists() else []:
        try:
            rec = json.loads(line)
            policy, step = rec["policy"], int(rec["step"])
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        if "eval_accuracy" in rec:
            evals[policy].append(rec)
        else:
            steps[policy].append(step)
            recovered += bool(rec.get("recovered"))
    problems = []
    for p, s in steps.items():
        if s != list(range(1, len(s) + 1)):
            dup = sorted(k for k, n in Counter(s).items() if n > 1)
            gaps = sorted(set(range(1, max(s) + 1)) - set(s))
            problems.append(f"{p}: training steps not 1..N (repeated {dup[:10]}, missing {gaps[:10]})")
    for p, e in evals.items():
        es = [x["step"] for x in e]
        if any(b <= a for a, b in zip(es, es[1:])):
            problems.append(f"{p}: evaluation steps not increasing: {es}")
    return {"steps": dict(steps), "evals": dict(evals), "recovered_lines": recovered, "bad_lines": bad,
            "problems": problems}


def weights_check(weights: Path, policy: str, final_step: int) -> dict[str, Any]:
    """The versions the weight store kept for ``policy`` and what is wrong with them."""
    store = WeightStore(weights)
    kept = store.versions(policy)
    problems = []
    if not kept or kept[-1] != final_step:
        problems.append(f"{policy}: newest committed version {kept[-1] if kept else None}, not {final_step}")
    if kept and kept != list(range(kept[0], kept[0] + len(kept))):
        problems.append(f"{policy}: kept versions not consecutive: {kept}")
    pdir = layout.policy_dir(weights, policy)
    uncommitted = sorted(d.name for d in pdir.iterdir() if layout.VERSION_DIR_RE.match(d.name)
                         and not (d / "COMMITTED").exists()) if pdir.is_dir() else []
    stage = layout.staging_root(weights, policy)
    staged = sorted(d.name for d in stage.iterdir()) if stage.is_dir() else []
    if uncommitted or staged:
        problems.append(f"{policy}: half-published versions left: {uncommitted + staged}")
    return {"kept": kept, "problems": problems}


def audit_run(run_dir: Path, max_steps: int | None = None) -> dict[str, Any]:
    """Audit ``run_dir`` (module docstring). ``max_steps``: the steps the run was asked for
    (default: from its resolved ``config.yaml``). ``ok`` is the verdict, ``problems`` says why not."""
    rp = RunPaths(run_dir)
    if max_steps is None:
        import yaml

        max_steps = int(yaml.safe_load(rp.config.read_text())["run"]["max_steps"])
    j = journal_counts(rp.ledger_journal)
    created, ended, final = j["created"], j["ended"], j["final"]
    created_twice = sorted(t for t, n in created.items() if n > 1)
    ended_twice = sorted(t for t, n in ended.items() if n > 1)
    never_ended = sorted(t for t in created if t not in ended)
    not_created = sorted(t for t in ended if t not in created)
    duplicated = sorted(t for t, n in j["consumed"].items() if n > 1)
    stored = committed_tasks(rp.trajectories)
    lost = sorted(t for t in stored if t not in final or final[t] == ("dropped", "served_not_trained"))
    m = metrics_check(rp.metrics)
    policies = sorted(m["steps"]) or ["solver"]
    final_steps = {p: (m["steps"].get(p) or [0])[-1] for p in policies}
    w = {p: weights_check(rp.weights, p, final_steps[p]) for p in policies}
    summary = json.loads(rp.summary.read_text()) if rp.summary.exists() else {}
    evals = m["evals"].get(policies[0], [])
    out = {
        "tasks": len(created), "outcomes": j["outcomes"], "dropped_by_reason": j["dropped_by_reason"],
        "failed_by_reason": j["failed_by_reason"],
        "created_twice": len(created_twice), "ended_twice": len(ended_twice), "never_ended": len(never_ended),
        "ended_not_created": len(not_created), "duplicated_trainings": len(duplicated),
        "stored_tasks": len(stored), "stored_entries": sum(stored.values()),
        "stored_more_than_once": sum(1 for n in stored.values() if n > 1),
        "lost_trajectories": len(lost), "lost_examples": lost[:5],
        "final_step": final_steps[policies[0]], "final_steps": final_steps, "max_steps": max_steps,
        "recovered_metric_lines": m["recovered_lines"], "bad_metric_lines": m["bad_lines"],
        "bad_journal_lines": j["bad_lines"],
        "weights_kept": {p: w[p]["kept"] for p in policies},
        "acc_before": evals[0]["eval_accuracy"] if evals else None,
        "acc_after": evals[-1]["eval_accuracy"] if evals else None,
        "eval_steps": [x["step"] for x in evals],
        "status": summary.get("status"), "reason": summary.get("reason"),
    }
    problems = [f"{n} task(s) {what}, e.g. {ex[:3]}" for n, what, ex in (
        (len(created_twice), "created more than once", created_twice),
        (len(ended_twice), "ended more than once", ended_twice),
        (len(never_ended), "created and never ended", never_ended),
        (len(not_created), "ended but never created", not_created),
        (len(duplicated), "consumed (trained on) more than once", duplicated),
        (len(lost), "with a committed trajectory lost", lost)) if n]
    problems += m["problems"] + [x for p in policies for x in w[p]["problems"]]
    problems += [f"{p}: {final_steps[p]} steps, not run.max_steps {max_steps}" for p in policies
                 if final_steps[p] != max_steps]
    if j["bad_lines"] or m["bad_lines"]:
        problems.append(f"unparsable lines: {j['bad_lines']} in ledger.jsonl, {m['bad_lines']} in metrics.jsonl")
    if summary.get("status") != "completed":
        problems.append(f"summary.json status {summary.get('status')!r} ({summary.get('reason')})")
    out["problems"] = problems
    out["ok"] = not problems
    return out
