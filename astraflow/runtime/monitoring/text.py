"""Monitoring room: the plain-text status of ``astraflow status`` and ``astraflow partitions
list``, formatted from the status snapshot as `run_status` returns it, and of a finished run
from its ``summary.json``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from astraflow.runtime.autoscale import pct
from astraflow.runtime.monitoring.disk import disk_line
from astraflow.runtime.monitoring.partition_stats import worker_of
from astraflow.runtime.monitoring.snapshot import orchestrator_alive


#: a trainer waiting longer than this for its next batch is said to be waiting, and how long
WAIT_SHOWN_S = 10.0


def batch_wait(trainer: dict[str, Any]) -> str:
    """`` waiting for a batch for 42s`` of a trainer whose wait for its next batch has lasted
    over `WAIT_SHOWN_S` (its wait fraction, over its lifetime, rises too slowly to tell)."""
    waited = float(trainer.get("batch_wait_s") or 0.0)
    return f" waiting for a batch for {waited:.0f}s" if waited > WAIT_SHOWN_S else ""


def format_partitions(st: dict[str, Any]) -> str:
    """One line per partition: kind, role, state, desired/live/serving workers, rate, error."""
    lines = [f"{'partition':<14} {'scheduler':<9} {'slurm':<8} {'role':<8} {'state':<9} "
             f"{'desired':>7} {'live':>4} {'serving':>7} {'episodes':>8} {'ep/s':>6}  jobs"]
    # a status without its autoscaler (``autoscale.enabled: false``) says partitions' bounds do not act
    scaling = st.get("autoscale") is not None if "autoscale" in st else None
    for name, p in st.get("partitions", {}).items():
        jobs = " ".join(f"{j}:{s}" for j, s in p.get("jobs", {}).items()) or "-"
        desired = 0 if p.get("state") in ("removing", "removed") else p["nodes"]  # as `status --json` says
        lines.append(
            f"{name:<14} {p['scheduler']:<9} {p.get('slurm_partition') or '-':<8} {p['role']:<8} "
            f"{p.get('state', '?'):<9} {desired:>7} {p.get('live', 0):>4} {p.get('serving', 0):>7} "
            f"{p.get('completed', 0):>8} {p.get('episodes_per_s', 0.0):>6.1f}  {jobs}"
        )
        if p.get("role") == "rollout":
            lines.append(partition_stats_line(p, scaling))
        queued = [f"{w['job_id']} ({w['reason']})" for w in st.get("workers", {}).values()
                  if w.get("partition") == name and w.get("reason")]
        if queued:  # a pending job's reason says what holds it (Resources, a node down, a limit)
            lines.append(f"  waiting in the queue: job {', '.join(queued)}")
        if p.get("failures"):
            wait = p.get("refill_in_s")
            lines.append(f"  failures: {p['failures']} worker(s) failed"
                         + (f"; refilling in {wait:.0f}s (backoff)" if wait else ""))
        if p.get("error"):
            lines.append(f"  error: {p['error']}")
    return "\n".join(lines)


def format_status(st: dict[str, Any]) -> str:
    dl = st.get("data_layer", {})
    info = st.get("orchestrator") or {}
    # a run whose orchestrator was killed took its dashboard with it (a silent one still serves it)
    gone = not st.get("running", True) and bool(info.get("pid")) and not orchestrator_alive(info)
    dashboard = ("not running: its dashboard is gone" if gone
                 else f"dashboard {info.get('dashboard')}" + _token_hint(st.get("run_dir")))
    if gone:  # its jobs' states are as old as its last status (`status --json` says UNKNOWN too)
        st = {**st, "workers": {n: {**w, "state": "UNKNOWN", "host": None} for n, w in st.get("workers", {}).items()},
              "partitions": {n: {**p, "jobs": {j: "UNKNOWN" for j in p.get("jobs", {})}}
                             for n, p in st.get("partitions", {}).items()}}
    lines = [
        f"run {st.get('run_dir')}{_who(info)}  elapsed {dl.get('elapsed_s', 0):.0f}s  "
        + dashboard,
        "policies:",
    ]
    waiting = st.get("waiting")
    if waiting:  # the orchestrator is restarting a component: the figures below are from before
        lines.insert(1, f"now: {waiting.get('what')} (for {time.time() - float(waiting.get('since', 0)):.0f}s)")
    restarts = st.get("trainer_restarts") or {}
    for p, t in st.get("trainers", {}).items():
        m = t.get("last_metrics", {})
        r = restarts.get(p, {})
        lines.append(
            f"  {p:<12} version {t['version']:>4}  reward {m.get('reward_mean', float('nan')):.3f}  "
            f"wait {t.get('wait_fraction', 0):.0%} since start  buffer {dl.get('buffers', {}).get(p, 0)}"
            + (f" {batch_wait(t)}" if batch_wait(t) else "")
            + (f"  restarts {r['count']}/{r.get('limit', '?')}" if r.get("count") else "")
        )
    dlr = st.get("data_layer_restarts") or {}
    if dlr.get("count"):
        last = (dlr.get("restarts") or [{}])[-1]  # records missing: the count alone
        lines.append(f"data layer: re-placed {dlr['count']}/{dlr.get('limit', '?')} time(s), last on "
                     f"{last.get('new_worker')} ({last.get('why')})")
    lines.append("partitions:")
    lines += ["  " + x for x in format_partitions(st).splitlines()]
    lines.append("workers:")
    for name, w in st.get("workers", {}).items():
        lines.append(
            f"  {name:<36} {w['job_id']:<14} {w['state']:<9} {w.get('phase', '-'):<9} "
            + (f"waiting: {w['reason']}  " if w.get("reason") else "")
            + (f"on {w['host']}  " if w.get("host") else "") + _worker_work(st, name, w)
        )
    idle = [n["idle_fraction"] for n in dl.get("nodes", {}).values() if "idle_fraction" in n and not n.get("gone")]
    trainers = st.get("trainers", {})
    # a trainer that took its last step waits no more, and wants no rollout (as the autoscaler's)
    training = {p: t for p, t in trainers.items() if not t.get("done")} or trainers
    waits = [t.get("wait_fraction", 0.0) for t in training.values()]
    if idle and waits:  # which side to grow: waiting trainers want rollout, idle nodes want training
        # both over the trainers' and nodes' lifetimes: the autoscaler's lines below say their window
        done = sorted(set(trainers) - set(training))
        lines.append(f"balance since start: trainer wait {max(waits):.0%}"
                     + (f" ({', '.join(done)} done)" if done else "") + f", rollout idle {sum(idle) / len(idle):.0%}")
    lines += autoscale_lines(st.get("autoscale"))
    lines.append(
        # the run's average (the partitions' lines above are over their last ~10 s)
        f"throughput since start: {dl.get('episodes_per_s', 0):.1f} episodes/s, "
        f"{dl.get('sequences_per_s', 0):.1f} sequences/s, "
        f"{dl.get('generated_tokens_per_s', 0):.0f} generated tok/s; "
        f"ledger {dl.get('ledger', {}).get('states', {})}"
    )
    lines += eval_lines(dl.get("eval", []))
    if st.get("disk"):
        lines += ["disk:"] + [disk_line(d) for d in st["disk"]]
    return "\n".join(lines)


#: the most recent evaluations a status shows per policy (the curve is in metrics.jsonl)
SHOWN_EVALS = 5


def _worker_work(st: dict[str, Any], name: str, w: dict[str, Any]) -> str:
    """What a worker of a status does: the trainers it runs (and their versions), the data layer,
    or its RaaS nodes' versions, episodes and rate."""
    role = (st.get("partitions", {}).get(w.get("partition")) or {}).get("role")
    if role == "trainer":
        hosted = [p for p, r in (st.get("trainer_restarts") or {}).items() if (r or {}).get("worker") == name]
        trainers = st.get("trainers", {})
        shown = [f"trainer of {p} at v{trainers.get(p, {}).get('version', '?')}" for p in hosted]
        return ", ".join(shown) or "trainer worker"
    if role == "data":
        return "the data layer"
    node = worker_nodes(name, st.get("data_layer", {}).get("nodes", {}))
    return ((f"{node['nodes']} nodes  " if node.get("nodes") else "")
            + f"versions {node.get('versions', '-')}  {node.get('completed', 0)} episodes  "
            f"{node.get('generated_tokens_per_s', 0):.0f} generated tok/s"
            + (f"  idle {node['idle_fraction']:.0%}" if "idle_fraction" in node else ""))


def worker_nodes(worker: str, nodes: dict[str, Any]) -> dict[str, Any]:
    """What the data layer knows of ``worker``'s nodes as one: its own entry, or its nodes'
    (``<worker>.n<i>``, ``rollout.nodes_per_worker``) summed, each policy's versions as ``"A-B"``
    where they differ and their mean idle fraction, with their count as ``nodes``."""
    if worker in nodes:
        return nodes[worker]
    mine = [i for n, i in nodes.items() if worker_of(n) == worker and not i.get("gone")]
    if not mine:
        return {}
    versions: dict[str, list[int]] = {}
    for i in mine:
        for p, v in (i.get("versions") or {}).items():
            versions.setdefault(p, []).append(int(v))
    idle = [float(i["idle_fraction"]) for i in mine if "idle_fraction" in i]
    return {"nodes": len(mine), "completed": sum(int(i.get("completed", 0)) for i in mine),
            "generated_tokens_per_s": sum(float(i.get("generated_tokens_per_s", 0.0)) for i in mine),
            "versions": {p: min(vs) if min(vs) == max(vs) else f"{min(vs)}-{max(vs)}" for p, vs in versions.items()},
            **({"idle_fraction": sum(idle) / len(idle)} if idle else {})}


def eval_lines(evals: list[dict[str, Any]]) -> list[str]:
    """The latest held-out accuracies, one line per policy (named when there are several)."""
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for e in evals:
        if "eval_accuracy" in e:
            by_policy.setdefault(str(e.get("policy", "")), []).append(e)
    out = []
    for policy, mine in by_policy.items():
        shown = ", ".join(f"v{e.get('step')}={e['eval_accuracy']:.3f}" for e in mine[-SHOWN_EVALS:])
        name = f" ({policy})" if len(by_policy) > 1 and policy else ""
        out.append(f"held-out accuracy{name}: {'..., ' if len(mine) > SHOWN_EVALS else ''}{shown}")
    return out


def format_summary(summary: dict[str, Any], where: str, partitions: dict[str, Any] | None = None) -> str:
    """A finished run in a few lines, from its ``summary.json`` (at ``where``): how it ended and
    why, the steps each policy took, its held-out accuracy, what each rollout partition
    (``partitions``: the summary's, else its last status's) generated, and its ledger."""
    seconds = summary.get("seconds")
    # ``seconds`` is the last incarnation's; a resumed run's run time (the data layer's) is longer
    run_time = (summary.get("data_layer") or {}).get("elapsed_s")
    resumed = isinstance(run_time, (int, float)) and isinstance(seconds, (int, float)) and run_time > seconds
    lines = [f"run finished: {outcome(summary)}"
             + (f" ({summary['reason']})" if summary.get("reason") else "")
             + (f" after {seconds:.0f}s" if isinstance(seconds, (int, float)) else "")
             + (f" (its last incarnation; {run_time:.0f}s of run time in all)" if resumed else "")
             + ("; stopped for a requeue: run again on its directory to resume it" if summary.get("requeue") else "")]
    steps = summary.get("steps") or {}
    lines.append("steps: " + (", ".join(f"{p} {n}" for p, n in steps.items()) or "none"))
    restarts = {p: r.get("count") for p, r in (summary.get("trainer_restarts") or {}).items()
                if isinstance(r, dict) and r.get("count")}
    dl_restarts = (summary.get("data_layer_restarts") or {}).get("count")
    if restarts or dl_restarts:
        lines.append("restarts: " + ", ".join([f"trainer {p} {n}" for p, n in restarts.items()]
                                              + ([f"data layer {dl_restarts}"] if dl_restarts else [])))
    for p, t in (summary.get("trainers") or {}).items():
        if isinstance(t, dict) and t.get("error"):
            lines.append(f"  {p} error: {t['error']}")
    lines += eval_lines(summary.get("eval") or [])
    lines += autoscale_lines(summary.get("autoscale"))
    lines += finished_partition_lines(partitions or {}, resumed)
    ledger = summary.get("ledger") or {}
    states = ", ".join(f"{k} {v}" for k, v in (ledger.get("states") or {}).items()) or "-"
    lines.append(f"ledger: {ledger.get('tasks', 0)} tasks: {states}"
                 + ("" if summary.get("ledger_closed", True) else " (the data layer was gone: its last state read)"))
    lines.append(f"summary: {where} (`astraflow status --json` for the whole final state)")
    return "\n".join(lines)


def finished_partition_lines(partitions: dict[str, Any], resumed: bool = False) -> list[str]:
    """Each rollout partition of a finished run: the episodes it completed, how stale what it
    generated was when trained on, the versions it served at the end (its last rates would say nothing).
    ``resumed``: its episodes are the last incarnation's (a resume starts its nodes' counts afresh),
    its consumed sequences the whole run's; said so."""
    out = []
    for name, p in partitions.items():
        if not isinstance(p, dict) or p.get("role") != "rollout":
            continue
        stale = _stale(p).replace(" consumed)", " consumed over the run)") if resumed else _stale(p)
        out.append(f"  {name} ({p.get('hardware') or p.get('scheduler', '?')}): {p.get('completed', 0)} episodes"
                   f"{' in its last incarnation' if resumed else ''}, {stale}, serving {_served(p)} at the end")
    return ["rollout partitions:", *out] if out else []


def _stale(p: dict[str, Any]) -> str:
    """How stale a partition's sequences were when trained on: mean, worst, how many."""
    mean, worst = p.get("staleness_mean"), p.get("staleness_max")
    return (f"staleness mean {mean:.2f} max {worst} ({p.get('consumed', 0)} consumed)" if mean is not None
            else "staleness -")


def _served(p: dict[str, Any]) -> str:
    """The versions each policy's engines of a partition served, ``pol:vA-vB``."""
    return " ".join(f"{pol}:" + (f"v{vs[0]}" if len(vs) == 1 else f"v{vs[0]}-v{vs[-1]}")
                    for pol, vs in (p.get("versions") or {}).items() if vs) or "-"


def _who(info: dict[str, Any]) -> str:
    """`` (pid P on HOST, Slurm job J)``: the `astraflow run` process `astraflow stop` signals, and
    the job to ``scancel`` from another host."""
    job = f", Slurm job {info['slurm_job']}" if info.get("slurm_job") else ""
    return f" (pid {info['pid']} on {info.get('host', '?')}{job})" if info.get("pid") else ""


def _token_hint(run_dir: Any) -> str:
    """Where the dashboard's address with its token is, when that file exists: only a run that
    served its page wrote one (and only its owner can see it)."""
    url_file = Path(str(run_dir)) / "security" / "dashboard.url"
    try:
        return f" (with the token in {url_file})" if run_dir and url_file.is_file() else ""
    except OSError:  # another user's run directory: its security/ is the owner's alone
        return ""


def outcome(summary: dict[str, Any]) -> str:
    """How the run ended: its ``status``; for a summary written before there was one, what its
    ``interrupted`` flag says (a run that failed then wrote no summary)."""
    if summary.get("status") is not None:
        return str(summary["status"])
    flag = summary.get("interrupted")
    return "?" if not isinstance(flag, bool) else "interrupted" if flag else "completed"


def partition_stats_line(p: dict[str, Any], scaling: bool | None = None) -> str:
    """A rollout partition's throughput, staleness of what it generated, versions served, what a
    node leases at once and autoscale bounds (``scaling`` False: the run's autoscaler is off), on
    one indented line."""
    served = _served(p)
    b = p.get("autoscale")
    bounds = f"; autoscale {b['min_nodes']}..{b['max_nodes']} nodes, cooldown {b['cooldown_s']:g}s" if b else ""
    if b and scaling is False:
        bounds += " (not acting: the run's autoscaler is off)"
    cap = p.get("capacity")
    leases = f", {cap['node_capacity']} episodes a node, engine batch {cap['engine_max_batch']}" if cap else ""
    return (f"  {p.get('episodes_per_s', 0.0):.1f} traj/s, {p.get('tokens_per_s', 0.0):.0f} tok/s, {_stale(p)}, "
            f"serving {served}{leases}{bounds}")


def autoscale_lines(a: dict[str, Any] | None) -> list[str]:
    """The autoscaler's band, its latest decision and its recent changes (none without one)."""
    if not a:
        return []
    c = a.get("config", {})
    out = [f"autoscale: band [{pct(c.get('low_wait', 0))}, {pct(c.get('high_wait', 0))}] of the trainer wait over "
           f"the last {c.get('window_s', 0):g}s" + (f", stale drops above {pct(c['max_stale_fraction'])} drain"
                                                if c.get("max_stale_fraction") is not None else "")]
    last = a.get("last")
    if last:
        out.append(f"  now: {last['action']}: {last['reason']}")
    for d in a.get("changes", [])[-5:]:
        out.append(f"  {time.strftime('%H:%M:%S', time.localtime(d['t']))} {d['reason']}")
    return out
