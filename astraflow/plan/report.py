"""The plan as rich tables: per pool and overall, then the sizes at which the trainer stops waiting.
A column too narrow for a value folds it onto the next line rather than cutting it."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from astraflow.plan.planner import PlanReport

#: a pool with less than this share of the generated trajectories is reported as idle
IDLE_SHARE = 0.01
#: a pool whose trajectories/s per GPU is under this fraction of the fastest pool's is reported
#: as slow when the trainer waits at least ``SLOW_WAIT``
SLOW_RATIO, SLOW_WAIT = 0.25, 0.1


def slow_pools(per_pool: dict[str, dict[str, float]], gpus: dict[str, int]) -> list[str]:
    """Pools far slower per GPU than the fastest: their tasks come back late while holding part
    of the work the data layer lets be in flight, which can leave the trainer waiting longer than
    without them."""
    rates = {k: row["trajectories_per_s"] / gpus[k] for k, row in per_pool.items() if gpus.get(k)}
    best = max(rates.values(), default=0.0)
    return [k for k, rate in rates.items() if best > 0 and rate < SLOW_RATIO * best]


def print_report(report: PlanReport, console: Console) -> None:
    r, shape = report.result, report.shape
    src = report.shape_sources
    console.print(f"assumed: trainer step {shape.step_seconds:.3g}s ({src['step_seconds']}), prompt "
                  f"{shape.prompt_tokens} tokens ({src['prompt_tokens']}), responses {shape.response_mean:.0f} tokens "
                  f"on average ({src['response_tokens']}); {r.steps} simulated steps at time scale "
                  f"{shape.time_scale:.2g} ({src['time_scale']})")
    table = Table(title="simulated throughput (steady part of the run, simulated time)")
    # staleness per pool over the whole run (the data layer counts it per node), the trainer table's of its steady part
    for col in ("pool", "GPUs", "trajectories/s", "tokens/s", "share", "staleness p50/p90/max, whole run"):
        table.add_column(col, justify="left" if col == "pool" else "right", overflow="fold")
    for kind, row in r.per_pool.items():
        stale = ("/".join(str(row[f"staleness_{q}"]) for q in ("p50", "p90", "max"))
                 if row.get("staleness_max") is not None else "-")
        table.add_row(kind, str(r.pools.get(kind, "")), f"{row['trajectories_per_s']:.4g}",
                      f"{row['tokens_per_s']:.4g}", f"{row['share']:.0%}", stale)
    table.add_row("all", str(sum(r.pools.values())), f"{r.trajectories_per_s:.4g}", f"{r.tokens_per_s:.4g}", "100%",
                  "", style="bold")
    console.print(table)
    idle = [kind for kind, row in r.per_pool.items() if row["share"] < IDLE_SHARE]
    if idle and len(idle) < len(r.per_pool):
        console.print(f"pool(s) {', '.join(idle)} generated (almost) nothing: the other pools' nodes took every "
                      "task the data layer let be in flight (dataflow.prefetch_groups, max_staleness and "
                      "admission); more of these GPUs would not help this config")
    slow = [k for k in slow_pools(r.per_pool, r.pools) if k not in idle] if r.trainer_wait >= SLOW_WAIT else []
    if slow:
        console.print(f"pool(s) {', '.join(slow)} deliver under {SLOW_RATIO:.0%} of the fastest pool's trajectories/s "
                      "per GPU: their tasks come back late and hold part of the work the data layer lets be in "
                      "flight, so the trainer may wait more with them than without; plan without them to compare")
    overall = Table(title="trainer")
    for col in ("steps/s", "trained/s", "trainer wait", "staleness p50/p90/max", "dropped stale/overflow/filtered",
                "dropped share of generated"):
        overall.add_column(col, justify="right", overflow="fold")
    drops = ("stale", "overflow", "filtered")
    overall.add_row(f"{r.steps_per_s:.3g}", f"{r.trained_per_s:.4g}", f"{r.trainer_wait:.0%}",
                    "/".join(str(r.staleness[k]) for k in ("p50", "p90", "max")),
                    "/".join(str(r.dropped[k]) for k in drops),
                    "/".join(f"{r.dropped_fraction.get(k, 0.0):.1%}" for k in drops))
    console.print(overall)
    s = report.search
    if s is None:
        return
    trials = Table(title=f"pool sizes vs trainer wait (target: at most {s.target:.0%})")
    for col in ("factor", "pools", "trainer wait", ""):
        trials.add_column(col, justify="right", overflow="fold")
    for t in sorted(s.trials, key=lambda t: t.factor):
        mark = "answer" if t.factor == s.factor else ("waits" if t.waits(s.target) else "")
        trials.add_row(f"x{t.factor:.3g}", " ".join(f"{k}={n}" for k, n in t.sizes), f"{t.wait:.0%}", mark)
    console.print(trials)
    if s.limited:
        grown = sorted(s.trials, key=lambda t: t.factor)[-2:]
        console.print(f"more GPUs did not lower the trainer wait (x{grown[0].factor:.3g}: {grown[0].wait:.0%}, "
                      f"x{grown[-1].factor:.3g}: {grown[-1].wait:.0%}), so the search stopped: pool size is not what "
                      "limits this run but the work the data layer lets be in flight (dataflow.prefetch_groups, "
                      "max_staleness and admission) against a sample's latency (weight loads, response length), "
                      "or the trainer itself")
    elif s.sizes is None:
        console.print(f"the trainer still waits at the largest sizes tried (x{max(t.factor for t in s.trials):.3g}): "
                      "if more GPUs barely changed the wait, what limits the run is not their number but how "
                      "long a sample takes to reach the trainer against the work the data layer lets be in "
                      "flight (dataflow.prefetch_groups, max_staleness and admission; weight-load time, "
                      "response length); else raise --max-trials")
    else:
        console.print(f"the trainer stops waiting at: {' '.join(f'{k}={n}' for k, n in s.sizes)} "
                      f"(x{s.factor:.3g} of the planned pools)")
