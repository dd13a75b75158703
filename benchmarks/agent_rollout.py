"""What the RaaS path costs on top of its inference engine for multi-turn agentic episodes.

``benchmarks/rollout_overhead.py`` measures single-turn episodes; an agentic episode adds
what only a multi-turn workflow pays: one engine request per model turn (through the engine
process's pipe on a node), an environment step or tool calls between turns, and contexts
that grow turn by turn. Side by side in one run, on the same model, tasks, sampling, episodes
in flight and engine batch size:

* **bare engine**: ``run_agent_episode`` over every task with ``HFEngine.generate`` called
  directly and the environment called inline, ``concurrency`` episodes in flight, in one
  process: no data layer, no store;
* **RaaS node**: a ``RaaSNode`` actor leasing the same tasks from a ``DataLayer`` actor
  (workers started as ``astraflow run`` starts them, the engine in its own process as by
  default), running the ``agent`` workflow, writing trajectories to a Zarr store on disk and
  completing them. Its numbers are read back from the store: the benchmark counts only what
  was committed.

The environment (``LedgerEnv``, one ``lookup`` tool) is defined here and is deterministic:
an episode takes exactly ``--turns`` model turns whatever a random-init model writes (the
environment ends it at that step; a turn spent on a tool call uses up one of ``max_turns``),
so both sides do the same work. ``--env-ms`` is the latency of one environment step (an
``asyncio.sleep``: a game engine or a remote service answering, no CPU). Both sides sample at
temperature 1 with the same seed; per-side generated tokens are reported so a reader can see
they match. Repetitions alternate bare and RaaS (load drifts hit both alike); the median
ratio is the result.

Reading the numbers:

* ``ratio_vs_bare_engine`` is RaaS episodes/s over bare episodes/s (goal >= 0.90). It can
  exceed 1: the bare side runs every episode's Python work (decoding text, parsing tool calls,
  rendering observations, the environment) on the engine's own thread between decoding
  steps, while a node runs it in its worker process beside the engine process;
* ``env_time_fraction``: seconds inside environment steps and tools over episode wall time,
  summed over episodes (``EpisodeLog.stats``). On the bare side an environment step's
  ``sleep`` also waits for the decoding step that holds the event loop, so its fraction is
  the larger one;
* ``mean batch`` (both sides) is well below the batch size: ``HFEngine`` batches statically,
  and a turn that misses a batch (its episode took a tool turn instead of an environment
  step, or its step returned a moment later) waits for that whole batch; episodes then stay
  out of phase. That is the engine's, on both sides alike, not the RaaS path's;
* the line under the table splits the RaaS side's own costs: lease round trips, store write +
  index time per episode, and the share of the wall time its engine was decoding.

    python benchmarks/agent_rollout.py [--episodes 96] [--turns 4] [--concurrency 32]
        [--max-batch 32] [--max-new-tokens 16] [--env-ms 5] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from pydantic import Field

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from astraflow.agents.env import Action, EnvironmentBase, Message, StepResult  # noqa: E402
from astraflow.agents.tools import ToolBox, tool  # noqa: E402
from astraflow.agents.workload import AgentParams, AgentWorkload  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402

#: how the data layer and the node name the workload (imported from this module on each worker)
WORKLOAD = "benchmarks.agent_rollout:LedgerWorkload"


def ledger_value(key: str) -> str:
    """The value the ledger holds under ``key`` (deterministic)."""
    return str(zlib.crc32(key.encode()) % 1000)


@tool(timeout_s=5)
def lookup(key: str) -> str:
    """The value stored under key in the ledger."""
    return ledger_value(key)


class LedgerEnv(EnvironmentBase):
    """Find the value of a key. The episode ends at the ``turns``-th environment step whatever
    the model wrote (reward 1 when that turn contains the value): a fixed number of model turns."""

    step_timeout_s = 10.0

    def __init__(self, turns: int, env_seconds: float):
        super().__init__()
        self.tools = ToolBox([lookup])
        self.turns, self.env_seconds, self.steps = turns, env_seconds, 0

    async def reset(self, task: Mapping[str, Any]) -> list[Message]:
        self.key = str(task["key"])
        return [{"role": "system", "content": "tools: " + self.tools.describe()},
                {"role": "user", "content": f"What is the value of {self.key}?"}]

    async def step(self, action: Action) -> StepResult:
        if self.env_seconds:
            await asyncio.sleep(self.env_seconds)
        self.steps += 1
        if self.steps >= self.turns:
            ok = float(ledger_value(self.key) in action.text)
            return StepResult([], reward=ok, done=True, info={"success": ok})
        return StepResult([{"role": "user", "content": f"not yet ({self.steps}/{self.turns})"}])


class LedgerParams(AgentParams):
    env_ms: float = Field(default=0.0, ge=0)
    """Latency of one environment step, in milliseconds."""


class LedgerWorkload(AgentWorkload):
    """``num_train`` keys; ``max_turns`` model turns per episode."""

    Params = LedgerParams

    def tasks(self, split: str) -> list[dict[str, Any]]:
        n = self.params.num_train if split == "train" else self.params.num_test
        return [{"key": f"{split}-{self.params.seed}-{i}"} for i in range(n)]

    def environment(self) -> LedgerEnv:
        return LedgerEnv(self.params.max_turns, self.params.env_ms / 1000)


def episode_numbers(rows: list[dict[str, Any]], wall_s: float) -> dict[str, float]:
    """Throughput and time split of one side: ``rows`` hold each episode's ``generated``
    tokens, ``stats`` (``EpisodeLog.stats``) and ``wall_s``."""
    n = len(rows)
    env_s = sum(r["stats"]["env_s"] + r["stats"]["tool_s"] for r in rows)
    return {"episodes": n, "tokens": sum(r["generated"] for r in rows), "wall_s": wall_s,
            "episodes_per_s": n / wall_s, "generated_tokens_per_s": sum(r["generated"] for r in rows) / wall_s,
            "turns_per_episode": sum(r["stats"]["turns"] for r in rows) / max(n, 1),
            "tool_calls": sum(r["stats"]["tool_calls"] + r["stats"]["invalid_calls"] for r in rows),
            "env_time_fraction": env_s / max(sum(r["wall_s"] for r in rows), 1e-9)}


def bare(model_dir: Path, workload: LedgerWorkload, tasks: list[dict], concurrency: int, max_batch: int,
         max_new: int, seed: int) -> dict[str, Any]:
    import torch

    from astraflow.agents.chat import ChatRenderer
    from astraflow.agents.episode import run_agent_episode
    from astraflow.rollout.engine import SamplingParams
    from astraflow.rollout.hf_engine import HFEngine

    torch.set_num_threads(1)
    engine = HFEngine(str(model_dir), version=0, max_batch_size=max_batch, seed=seed, device="cpu")
    renderer = ChatRenderer(engine.tokenizer)
    params, limits = SamplingParams(max_new_tokens=max_new), workload.limits(max_new)

    async def generate(tokens: list[int], n: int):
        return await engine.generate(tokens, replace(params, max_new_tokens=n))

    async def go() -> list[dict[str, Any]]:
        sem = asyncio.Semaphore(concurrency)

        async def one(task):
            async with sem:
                t0 = time.perf_counter()
                ep = await run_agent_episode(generate, renderer, workload.environment(), task, limits)
                return {"generated": sum(ep.loss_mask), "stats": ep.stats(), "wall_s": time.perf_counter() - t0}

        return list(await asyncio.gather(*(one(t) for t in tasks)))

    t0 = time.perf_counter()
    rows = asyncio.run(go())
    out = episode_numbers(rows, time.perf_counter() - t0)
    out["engine"] = engine.stats()
    return out


def raas(workers: tuple, model_dir: Path, work: Path, params: dict[str, Any], groups: int, group_size: int,
         concurrency: int, max_batch: int, max_new: int, seed: int) -> dict[str, Any]:
    """One RaaS run on ``workers`` (``rollout_overhead.system_workers``): a fresh data layer,
    node, weight store and trajectory store under ``work``."""
    from astraflow.dataflow.config import DataflowConfig
    from astraflow.dataflow.layer import DataLayer
    from astraflow.rollout.config import EngineConfig, RolloutConfig
    from astraflow.rollout.node import NodeIdentity, RaaSNode
    from astraflow.workloads.config import EvalConfig, SamplingConfig, WorkloadConfig
    from storage.trajectories import EntryRef, open_trajectory_store
    from storage.weights import WeightStore

    n = groups * group_size
    weights, store = work / "weights", work / "trajectories"
    WeightStore(weights)  # an empty store: the node serves the model directory as version 0
    client, data_addr, rollout_addr = workers
    wl = WorkloadConfig(name=WORKLOAD, workflow="agent", params=params, group_size=group_size,
                        sampling=SamplingConfig(max_new_tokens=max_new), eval=EvalConfig(every=0))
    # groups_per_batch (1) + prefetch_groups: the data layer creates exactly ``groups`` groups
    dl = client.submit(
        DataLayer, actor=True, workers=[data_addr],
        dataflow=DataflowConfig(batch_size=group_size, prefetch_groups=groups - 1), workload=wl,
        policies=["p"], store_url=str(store), metrics_path=None, max_steps=1, seed=seed,
    ).result(timeout=120)
    node = client.submit(
        RaaSNode, actor=True, workers=[rollout_addr], identity=NodeIdentity(name="bench"),
        rollout=RolloutConfig(capacity=concurrency, engine=EngineConfig(max_batch=max_batch, device="cpu")),
        models={"p": str(model_dir)}, workload_name=WORKLOAD, workload_params=params, workload_seed=0,
        workflow="agent", sampling=wl.sampling, store_url=str(store), weights_root=str(weights),
        data_layer=dl, seed=seed,
    ).result(timeout=120)
    node.start().result(timeout=300)
    t0 = time.perf_counter()  # engine loaded: from here on it is lease, episodes, write, complete
    deadline = time.time() + 900
    while dl.progress().result(timeout=30)["sequences_generated"] < n:
        if time.time() > deadline:
            raise TimeoutError(f"the RaaS node completed fewer than {n} episodes within 900 s")
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    nst = node.stop(timeout=60).result(timeout=90)
    reader = open_trajectory_store(str(store), "r")
    rows = []
    for row in reader.read([EntryRef(s, i) for s in reader.segments() for i in range(reader.count(s))]):
        meta = json.loads(row.meta)
        prov = meta["provenance"]
        rows.append({"generated": int(row.loss_mask.sum()), "stats": meta["stats"],
                     "wall_s": prov["finished_at"] - prov["started_at"]})
    assert len(rows) >= n, f"{len(rows)} trajectories in the store, {n} completed"
    out = episode_numbers(rows[:n], wall)
    out["engine"], out["counters"] = nst["engine"]["p"], nst["counters"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=at_least(1), default=96, help="episodes per side (a multiple of --group-size)")
    ap.add_argument("--turns", type=at_least(1), default=4, help="model turns per episode")
    ap.add_argument("--concurrency", type=at_least(1), default=32, help="episodes in flight (both sides)")
    ap.add_argument("--max-batch", type=at_least(1), default=32, help="engine batch size (both sides)")
    ap.add_argument("--max-new-tokens", type=at_least(1), default=16, help="token budget of one model turn")
    ap.add_argument("--group-size", type=at_least(1), default=4, help="episodes per task (a GRPO group)")
    ap.add_argument("--env-ms", type=at_least(0, float), default=5.0, help="latency of one environment step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=at_least(1), default=3, help="alternating bare/RaaS repetitions (median reported)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 episodes, 2 turns, 1 repetition")
    args = ap.parse_args(argv)
    if args.quick:
        args.episodes, args.turns, args.concurrency, args.max_batch, args.reps = 8, 2, 8, 8, 1
        args.max_new_tokens, args.group_size = 8, 2
    if args.episodes % args.group_size:
        raise SystemExit(f"--episodes ({args.episodes}) must be a multiple of --group-size ({args.group_size})")

    from rich.console import Console
    from rich.table import Table

    from astraflow.models import init_model
    from astraflow.workloads.base import make_workload
    from benchmarks.rollout_overhead import system_workers

    # the workers import this module by name (``WORKLOAD``)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="agent-rollout-", dir=ROOT / "benchmarks" / "out"))
    groups = args.episodes // args.group_size
    params = {"max_turns": args.turns, "max_context_tokens": 2048, "num_train": groups, "num_test": 1,
              "env_ms": args.env_ms}
    try:
        model_dir = init_model(work / "model", preset="tiny", seed=args.seed)
        workload = make_workload(WORKLOAD, params, 0)
        # every train task once per group member: the tasks the data layer hands out (in its order)
        tasks = [t for t in workload.tasks("train") for _ in range(args.group_size)]
        reps = []
        with system_workers(work / "cluster") as workers:
            for rep in range(args.reps):
                b = bare(model_dir, workload, tasks, args.concurrency, args.max_batch, args.max_new_tokens,
                         args.seed)
                r = raas(workers, model_dir, work / f"rep{rep}", params, groups, args.group_size,
                         args.concurrency, args.max_batch, args.max_new_tokens, args.seed)
                reps.append({"bare": b, "raas": r, "ratio": r["episodes_per_s"] / b["episodes_per_s"]})
                print(f"rep {rep + 1}/{args.reps}: ratio {reps[-1]['ratio']:.3f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"agent rollout ({args.episodes} episodes x {args.turns} turns, {args.concurrency} in "
                        f"flight, engine batch {args.max_batch}, {args.max_new_tokens} new tokens/turn, "
                        f"env step {args.env_ms:g} ms, tiny model)")
    for col in ("rep", "path", "episodes", "gen tokens", "turns/ep", "tool calls", "seconds", "episodes/s",
                "tokens/s", "env frac", "engine busy s", "mean batch", "ratio"):
        table.add_column(col, justify="right")
    for i, x in enumerate(reps):
        for name, key in (("bare engine", "bare"), ("RaaS node", "raas")):
            s, e = x[key], x[key]["engine"]
            table.add_row(str(i + 1) if key == "bare" else "", name, str(s["episodes"]), str(s["tokens"]),
                          f"{s['turns_per_episode']:.2f}", str(int(s["tool_calls"])), f"{s['wall_s']:.2f}",
                          f"{s['episodes_per_s']:.2f}", f"{s['generated_tokens_per_s']:.0f}",
                          f"{s['env_time_fraction']:.3f}", f"{e['busy_seconds']:.2f}",
                          f"{e['requests'] / max(e['batches'], 1):.1f}", f"{x['ratio']:.3f}" if key == "raas" else "")
    Console(width=200).print(table)
    ratio = statistics.median(x["ratio"] for x in reps)  # an even count: the mean of the middle two
    # the other figures: one repetition's, consistent with each other (the one at the lower median ratio)
    low = statistics.median_low(x["ratio"] for x in reps)
    med = next(x for x in reps if x["ratio"] == low)
    b, r, c = med["bare"], med["raas"], med["raas"]["counters"]
    busy = {k: med[k]["engine"]["busy_seconds"] / med[k]["wall_s"] for k in ("bare", "raas")}
    batch = {k: med[k]["engine"]["requests"] / max(med[k]["engine"]["batches"], 1) for k in ("bare", "raas")}
    print(f"median of {len(reps)}: ratio {ratio:.3f}; RaaS: {int(c['lease_calls'])} lease calls "
          f"({c['lease_s']:.2f} s, overlapping decoding), store write+index "
          f"{1000 * c['write_s'] / max(c['episodes'], 1):.2f} ms/episode, engine decoding "
          f"{100 * busy['raas']:.0f} % of the wall time (bare {100 * busy['bare']:.0f} %)")
    result = {
        "ratio_vs_bare_engine": round(ratio, 3),
        "ratios": [round(x["ratio"], 3) for x in reps],
        "episodes_per_s": round(r["episodes_per_s"], 3),
        "generated_tokens_per_s": round(r["generated_tokens_per_s"], 1),
        "generated_tokens": r["tokens"],
        "env_time_fraction": round(r["env_time_fraction"], 4),
        "bare_episodes_per_s": round(b["episodes_per_s"], 3),
        "bare_generated_tokens_per_s": round(b["generated_tokens_per_s"], 1),
        "bare_generated_tokens": b["tokens"],
        "bare_env_time_fraction": round(b["env_time_fraction"], 4),
        "engine_busy_fraction": round(busy["raas"], 3), "bare_engine_busy_fraction": round(busy["bare"], 3),
        "mean_batch": round(batch["raas"], 1), "bare_mean_batch": round(batch["bare"], 1),
        "lease_calls": int(c["lease_calls"]),
        "write_ms_per_episode": round(1000 * c["write_s"] / max(c["episodes"], 1), 2),
        "episodes": args.episodes, "turns": args.turns, "concurrency": args.concurrency,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
