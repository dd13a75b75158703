"""What the RaaS machinery costs on top of its inference engine.

Side by side in one run, on the same model, prompts, sampling, in-flight count and engine
batch size:

* **bare engine**: the engine's ``generate`` (``HFEngine``; ``VLLMEngine`` with ``--engine vllm``) for every prompt, ``capacity`` requests in flight,
  in one process (with a session of its own, as the RaaS path's worker has: Linux's autogroup
  scheduling divides the CPUs between sessions first): the engine alone, fed as fast as it can
  take requests;
* **RaaS node**: a ``RaaSNode`` actor on a Dask worker, leasing the same number of tasks from
  a ``DataLayer`` actor on another worker, running the ``single_turn`` workflow, writing
  trajectories to a Zarr store on disk and completing them (no trainer: a RaaS node runs alone
  against a data layer). The scheduler and workers are started exactly as ``astraflow run``
  starts them, with the run's mutual TLS, and the node runs its engine as configured by default
  (in its own process);
* **RaaS node, plain TCP**: the same with TLS turned off (``cluster.tls.enabled: false``), so
  the cost of encrypting and authenticating the run's Dask traffic is measured too.

Reports generated tokens/s of all three, the RaaS/bare ratio (goal >= 0.95) and the TLS/plain
ratio, each engine's busy time and mean batch (vLLM: mean requests in flight), the cores each
process kept busy (and the whole machine: on a shared machine the other users' load shows
there), and the store write + index time per trajectory in milliseconds. Both paths build the
engine from the same settings (``--cpu-bind`` included). Repetitions alternate the three (load drifts hit all alike); the median
ratios are the result.

    python benchmarks/rollout_overhead.py [--groups 200] [--reps 3] [--capacity 128] [--max-batch 64]
        [--cpu-bind none] # vLLM's CPU build, both paths: threads left unbound (rollout.engine.vllm.cpu_bind)
        [--tls-only]     # leave out the plain-TCP run
        [--profile-node] # where the rollout worker's CPU goes (per thread, sampled stacks)
        [--in-process]   # the engine inside the node's worker process (rollout.engine.process: false)
        [--engine vllm]  # both paths on the vLLM engine (vLLM's own engine core process)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cloudpickle  # noqa: E402

from benchmarks import proc_profile  # noqa: E402
from benchmarks.proc_profile import cpu_delta, print_profile, process_cpu, start_sampler, stop_sampler  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402

cloudpickle.register_pickle_by_value(proc_profile)  # client.run sends its sampler to a worker


def _bare_child(conn, *args) -> None:
    os.setsid()  # a session (scheduler autogroup) of its own, as each worker of the RaaS path has
    conn.send(bare(*args))
    conn.close()


def bare_in_own_session(*args) -> tuple[float, int, dict]:
    """``bare(*args)`` in a child process that starts a session of its own. Linux's autogroup
    scheduling shares the CPUs between sessions before threads, and the RaaS path's engine runs
    in the session of the rollout worker ``astraflow run`` starts: the bare engine gets the same
    standing, instead of sharing the benchmark's session."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_bare_child, args=(child, *args))
    proc.start()
    child.close()
    try:
        return parent.recv()
    finally:
        proc.join(120)


def bare(model_dir: Path, prompts: list[list[int]], capacity: int, max_batch: int, max_new: int, seed: int,
         engine_type: str = "hf", cpu_bind: str = "cores", device: str = "cpu") -> tuple[float, int, dict]:
    import torch

    from astraflow.rollout.config import EngineConfig
    from astraflow.rollout.engine import SamplingParams
    from astraflow.rollout.engines import make_engine
    from astraflow.rollout.hf_engine import HFEngine

    torch.set_num_threads(1)
    if engine_type == "hf":
        engine = HFEngine(str(model_dir), version=0, max_batch_size=max_batch, seed=seed, device=device)
    else:  # built as the node builds it
        engine = make_engine(EngineConfig(type=engine_type, max_batch=max_batch, vllm={"cpu_bind": cpu_bind},
                                          device=device),
                             str(model_dir), seed=seed)
    params = SamplingParams(max_new_tokens=max_new)

    async def go() -> int:
        sem = asyncio.Semaphore(capacity)

        async def one(p):
            async with sem:
                return len((await engine.generate(p, params)).tokens)

        return sum(await asyncio.gather(*(one(p) for p in prompts)))

    if engine_type != "hf":  # vLLM's first requests allocate; the node path starts timing after its start too
        async def warm():
            await asyncio.gather(*(engine.generate(p, params) for p in prompts[:8]))

        asyncio.run(warm())
    cpu0, t0 = process_cpu(), time.perf_counter()
    tokens = asyncio.run(go())
    wall = time.perf_counter() - t0
    stats = dict(engine.stats(), cores=cpu_delta(cpu0, process_cpu(), wall))
    engine.close()
    return wall, tokens, stats


@contextlib.contextmanager
def system_workers(work: Path, tls: bool = True):
    """A Dask scheduler, a data worker and a rollout worker, started exactly as ``astraflow run``
    starts them (``SchedulerProcess`` + ``LocalScheduler``: no nanny; with the run's mutual TLS
    unless `tls` is false). Yields the client and
    the two worker addresses. (A ``LocalCluster``'s nannies set ``MALLOC_TRIM_THRESHOLD_``,
    which alone cost the engine 20-40 % of its tokens/s here: not what a user runs.)"""
    from distributed import Client

    from astraflow.runtime.cluster import SchedulerProcess, connected_workers
    from astraflow.runtime.security import client_security, create_run_certificates
    from schedulers.local import LocalScheduler
    from schedulers.partition import Partition
    from storage.paths import RunPaths

    paths = RunPaths(work)
    paths.logs.mkdir(parents=True, exist_ok=True)
    files = create_run_certificates(work / "security") if tls else None
    scheduler = SchedulerProcess(paths, dashboard_port=0, tls=files)
    address = scheduler.start()
    workers = LocalScheduler(paths.logs, tls=files)
    try:
        for role in ("data", "rollout"):
            workers.submit(Partition(name="bench", role=role, region="home", hardware="cpu"), address, count=1)
        with Client(address, security=client_security(files)) as client:
            deadline = time.time() + 120
            while len(connected_workers(client)) < 2:
                if time.time() > deadline:
                    raise TimeoutError(f"benchmark workers did not join within 120 s; see {paths.logs}")
                time.sleep(0.2)
            by_name = {w["name"]: a for a, w in connected_workers(client).items()}
            yield client, by_name["data-bench-home-cpu-0"], by_name["rollout-bench-home-cpu-0"]
    finally:
        workers.close()
        scheduler.stop()


def raas(model_dir: Path, work: Path, n_tasks: int, groups: int, group_size: int, capacity: int,
         max_batch: int, max_new: int, digits: int, seed: int, engine_process: bool = True, tls: bool = True,
         engine_type: str = "hf", profile: bool = False, cpu_bind: str = "cores", device: str = "cpu") -> dict:
    from astraflow.dataflow.config import DataflowConfig
    from astraflow.rollout.config import EngineConfig, RolloutConfig
    from astraflow.workloads.config import EvalConfig, SamplingConfig, WorkloadConfig
    from astraflow.dataflow.layer import DataLayer
    from astraflow.rollout.node import NodeIdentity, RaaSNode
    from storage.weights import WeightStore

    weights = work / "weights"
    WeightStore(weights)  # an empty store: the node serves the model directory as version 0
    with system_workers(work, tls) as (client, data_addr, rollout_addr):
        wl = WorkloadConfig(name="math", params={"digits": digits}, group_size=group_size,
                            sampling=SamplingConfig(max_new_tokens=max_new), eval=EvalConfig(every=0))
        dl = client.submit(
            DataLayer, actor=True, workers=[data_addr],
            dataflow=DataflowConfig(batch_size=group_size, prefetch_groups=groups), workload=wl,
            policies=["p"], store_url=str(work / "trajectories"), metrics_path=None, max_steps=1, seed=seed,
        ).result(timeout=120)
        node = client.submit(
            RaaSNode, actor=True, workers=[rollout_addr], identity=NodeIdentity(name="bench"),
            rollout=RolloutConfig(capacity=capacity, engine=EngineConfig(type=engine_type, max_batch=max_batch,
                                                                            vllm={"cpu_bind": cpu_bind},
                                                                            device=device, process=engine_process)),
            models={"p": str(model_dir)}, workload_name="math", workload_params={"digits": digits},
            workload_seed=0, workflow="single_turn", sampling=wl.sampling, store_url=str(work / "trajectories"),
            weights_root=str(weights), data_layer=dl, seed=seed,
        ).result(timeout=120)
        node.start().result(timeout=300)
        if profile:
            client.run(start_sampler, workers=[rollout_addr])
        pids = client.run(os.getpid)
        known = {pids[rollout_addr]: "rollout worker (node)", pids[data_addr]: "data worker"}
        cpu0 = process_cpu(known)
        t_start = time.perf_counter()  # engine loaded: from here on it is lease, generate, write, complete
        deadline = time.time() + 900
        while time.time() < deadline:
            st = dl.progress().result(timeout=30)
            if st["sequences_generated"] >= n_tasks:
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t_start
        cores = cpu_delta(cpu0, process_cpu(known), wall)
        if profile:
            print_profile(client.run(stop_sampler, workers=[rollout_addr])[rollout_addr], wall)
        nst = node.stop(timeout=60).result(timeout=90)
    c = nst["counters"]
    busy = nst["engine"]["p"]["busy_seconds"]
    nst["engine"]["p"]["cores"] = cores
    return {"counters": c, "engine_busy_s": busy, "node": nst, "wall_s": wall,
            "tokens_at_end": st["tokens_generated"]}


def _mean_batch(stats: dict, wall: float, engine: str) -> float:
    """The HF engine's mean decode batch; for vLLM, which schedules its own steps, the mean
    number of requests in flight (request-seconds / wall: vLLM runs up to ``max_batch`` of them)."""
    if engine == "vllm":
        return stats["busy_seconds"] / wall
    return stats["requests"] / max(stats["batches"], 1)


def print_tables(rows: list[dict], args, n: int, plain: bool = True) -> None:
    """Throughput per path and repetition, then the cores each process kept busy."""
    from rich.console import Console
    from rich.table import Table

    where = "" if args.engine == "vllm" else " in the worker" if args.in_process else " in its own process"
    table = Table(title=f"rollout overhead ({n} episodes, {args.capacity} in flight, engine batch {args.max_batch}, "
                        f"{args.preset} model, {args.engine} engine{where})")
    batch = "mean in flight" if args.engine == "vllm" else "mean batch"
    for col in ("rep", "path", "tokens", "seconds", "tokens/s", "engine busy s", batch, "ratio to bare"):
        table.add_column(col, justify="right")
    paths = [("bare engine", "bare"), ("RaaS node (TLS)", "raas"), ("RaaS node (plain TCP)", "plain")][:3 if plain else 2]
    cores = Table(title="cores busy during the timed part (CPU seconds / wall; machine: every process, "
                        "other users' too)")
    roles = sorted({r for x in rows for _, key in paths for r in x[f"{key}_stats"]["cores"]})
    for col in ("rep", "path", *roles):
        cores.add_column(col, justify="right")
    for i, x in enumerate(rows):
        for label, key in paths:
            st, wall, toks = x[f"{key}_stats"], x[f"{key}_s"], x[f"{key}_tokens"]
            ratio = "" if key == "bare" else f"{(toks / wall) / (x['bare_tokens'] / x['bare_s']):.3f}"
            table.add_row(str(i + 1) if key == "bare" else "", label, str(int(toks)), f"{wall:.2f}",
                          f"{toks / wall:.0f}", f"{st['busy_seconds']:.2f}",
                          f"{_mean_batch(st, wall, args.engine):.1f}", ratio)
            cores.add_row(str(i + 1) if key == "bare" else "", label,
                          *(f"{st['cores'][r]:.2f}" if r in st["cores"] else "" for r in roles))
    Console().print(table)
    Console().print(cores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=at_least(1), default=200, help="prompts rolled out per path and repetition")
    ap.add_argument("--group-size", type=at_least(1), default=8, help="samples per prompt")
    ap.add_argument("--capacity", type=at_least(1), default=128, help="episodes in flight (both paths)")
    ap.add_argument("--max-batch", type=at_least(1), default=64, help="engine batch size (both paths)")
    ap.add_argument("--max-new-tokens", type=at_least(1), default=16, help="tokens generated per sample at most")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="model size preset")
    ap.add_argument("--digits", type=at_least(1), default=2, help="digits of the addition problems (prompt length)")
    ap.add_argument("--seed", type=int, default=0, help="model init and sampling seed")
    ap.add_argument("--reps", type=at_least(1), default=3, help="alternating bare/RaaS repetitions (median reported)")
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                    help="the engine of both paths (vllm: needs vLLM installed, e.g. the venv of tests/run_vllm.sh)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda:0"],
                    help="where both paths run their engine (cuda:0: the first GPU)")
    ap.add_argument("--cpu-bind", default="cores", choices=["cores", "none"],
                    help="vLLM CPU build: rollout.engine.vllm.cpu_bind of both paths (the same in both)")
    ap.add_argument("--tls-only", action="store_true",
                    help="leave out the plain-TCP run (a third shorter; no TLS/plain ratio)")
    ap.add_argument("--profile-node", action="store_true",
                    help="sample the rollout worker's threads during the TLS run (per-thread CPU, top functions)")
    ap.add_argument("--in-process", action="store_true",
                    help="run the node's engine inside its worker process (rollout.engine.process: false)")
    args = ap.parse_args()
    from benchmarks.run_checks import cuda_problem

    problem = cuda_problem(args.device)
    if problem:  # else the bare engine's child fails with a traceback and this process with EOFError
        ap.error(problem)
    if args.engine == "vllm":
        from astraflow.rollout.vllm_setup import require_vllm

        try:
            require_vllm("--engine")
        except ValueError as err:
            ap.error(str(err))  # exit 2 before anything starts, no traceback

    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rollout-overhead-", dir=ROOT / "benchmarks" / "out"))
    try:  # the scratch directory goes on a failure or Ctrl-C too
        rows = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = args.groups * args.group_size
    print_tables(rows, args, n, plain=not args.tls_only)
    # medians of the repetitions, each figure its own (an even count averages the middle two)
    ratio, tls_ratio = statistics.median(x["ratio"] for x in rows), statistics.median(x["tls_ratio"] for x in rows)
    bare_tps = statistics.median(x["bare_tokens"] / x["bare_s"] for x in rows)
    raas_tps = statistics.median(x["raas_tokens"] / x["raas_s"] for x in rows)
    overhead_ms = statistics.median(1000 * x["c"]["write_s"] / max(x["c"]["episodes"], 1) for x in rows)
    print(f"median of {len(rows)}: ratio {ratio:.3f}, TLS/plain TCP {tls_ratio:.3f}; per-trajectory store write+index "
          f"{overhead_ms:.2f} ms (lease calls overlap decoding and are not counted)")
    print("RESULT " + json.dumps({
        "ratio_vs_bare_engine": round(ratio, 3),
        "ratios": [round(x["ratio"], 3) for x in rows],
        "tls_vs_plain_tcp": round(tls_ratio, 3),
        "tls_vs_plain_tcp_ratios": [round(x["tls_ratio"], 3) for x in rows],
        "bare_tokens_per_s": round(bare_tps, 1),
        "raas_tokens_per_s": round(raas_tps, 1),
        "overhead_ms_per_trajectory": round(overhead_ms, 3),
        "episodes": int(rows[-1]["c"]["episodes"]),
        "engine_process": not args.in_process,
        "engine": args.engine,
        "cpu_bind": args.cpu_bind,
        "device": args.device,
    }))


def measure(args, work: Path) -> list[dict]:
    """The repetitions, each a (bare, RaaS, RaaS plain TCP) triple, with their scratch under ``work``."""
    from astraflow.models import init_model
    from astraflow.workloads.base import make_workload

    model_dir = init_model(work / "model", preset=args.preset, seed=args.seed)
    wl = make_workload("math", {"digits": args.digits}, 0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    train = wl.tasks("train")
    n = args.groups * args.group_size
    # the data layer shuffles prompts; the bare run uses the same prompt distribution and count
    prompts = [tok.encode(wl.render_prompt(train[i % len(train)])) for i in range(args.groups) for _ in range(args.group_size)]

    rows = []  # one (bare, RaaS, RaaS plain TCP) triple per repetition, alternating: load drifts hit all alike
    for rep in range(args.reps):
        bare_s, bare_tokens, bare_stats = bare_in_own_session(model_dir, prompts, args.capacity, args.max_batch, args.max_new_tokens, args.seed,
                                                 args.engine, args.cpu_bind, args.device)
        order = (True,) if args.tls_only else (True, False) if rep % 2 == 0 else (False, True)
        runs = {tls: raas(model_dir, work / f"rep{rep}-{'tls' if tls else 'tcp'}", n, args.groups, args.group_size,
                          args.capacity, args.max_batch, args.max_new_tokens, args.digits, args.seed,
                          engine_process=not args.in_process, tls=tls, engine_type=args.engine,
                          profile=args.profile_node and tls, cpu_bind=args.cpu_bind, device=args.device)
                for tls in order}
        r, plain = runs[True], runs.get(False, runs[True])  # --tls-only: TLS/plain reads 1
        c = r["counters"]
        # end to end: from the engine being loaded to the last trajectory completed in the data layer
        rows.append(dict(bare_s=bare_s, bare_tokens=bare_tokens, bare_stats=bare_stats, raas_s=r["wall_s"],
                         raas_tokens=c["tokens"], c=c, raas_stats=r["node"]["engine"]["p"],
                         ratio=(c["tokens"] / r["wall_s"]) / (bare_tokens / bare_s),
                         plain_s=plain["wall_s"], plain_tokens=plain["counters"]["tokens"],
                         plain_stats=plain["node"]["engine"]["p"],
                         tls_ratio=(c["tokens"] / r["wall_s"]) / (plain["counters"]["tokens"] / plain["wall_s"])))
        print(f"rep {rep + 1}/{args.reps}: ratio {rows[-1]['ratio']:.3f}, TLS/plain {rows[-1]['tls_ratio']:.3f}",
              flush=True)

    return rows


if __name__ == "__main__":
    main()
