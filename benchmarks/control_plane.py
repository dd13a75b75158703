"""The control plane at scale: many RaaS nodes against one data layer, side by side.

What runs: a real ``DataLayer`` actor on a real Dask ``LocalCluster`` worker (processes=True,
Dask's quiet settings), with its durability snapshot and ledger journal, and the real
trajectory store on disk in a temp dir. 10, 100 and 1,000 emulated RaaS nodes
(``control_plane_nodes.EmuNode``: heartbeats, leases, a timer per episode, tiny
trajectories through the real segment writer, completions) run on the asyncio loops of
``--emulator-procs`` processes of their own (as node groups run in worker processes of their
own; 0: on this process's loop), grouped ``--nodes-per-worker`` to a worker, a worker's nodes
in one process; every caller calls the actor's worker directly, as callers on Dask workers
do (not through the scheduler). A consumer in this process takes ``--batch-size``
sequence batches and publishes a version after each. The data layer serves batches by
reference, so the consumer does what a trainer does: it reads each batch's rows from the store
and makes the ``Batch``, in a process of its own (the emulated trainer's; its CPU per sequence
is ``trainer_read_cpu_us_per_seq``, not part of the data layer's ``dl_cpu_us_per_traj``, but
it runs on the same 2 cores). Two call patterns:

* ``per-node``: every node calls ``heartbeat`` / ``lease`` / ``complete`` itself (the call
  pattern before node groups gathered their calls);
* ``grouped``: the nodes of a worker share a ``Coalescer`` (``lease_many``,
  ``heartbeat_many``, one ``complete``);
* ``stocked``: ``grouped``, and the nodes' leases are served from the worker's lease stock
  (``--lease-ahead``), as ``RaaSNodeGroup`` does with ``rollout.lease_ahead`` > 0 (opt-in).

The headline figures of the result (``traj_per_s_1000_nodes``, ``p99_lease_ms_1000_nodes``) are
the default's, ``grouped`` (``headline_calls`` says which, when it was not measured); the other
patterns' come under their names (``stocked_p99_lease_ms_1000_nodes``).

``--baseline-root DIR`` also runs the per-node pattern against another checkout's code (e.g.
the main branch, before these changes) in a subprocess: its rows are marked ``baseline``.

Measured in a window of ``--seconds`` after ``--warmup``: trajectories/s completed (ingested)
and sequences/s batched (``traj_per_s_1000_nodes`` in the result is the lower of the two: what
flows end to end); p50/p99 latency of lease, heartbeat, complete and next_batch as the
nodes and the consumer see them, and inside the data layer (``dl_*``: entry to answer, from its
``state()["service_ms"]``); how late the emulators' own event loops run a timer
(``loop_lag``: a node's answer waits at least that long); a trivial call every 20 ms from an
idle process of its own (``probe``: what the data layer's worker adds under the load, without
an emulator's delays); the data-layer worker's CPU seconds per trajectory (from
``/proc`` via psutil). On a shared 2-core machine the emulated nodes take CPU from the data
layer, so ``dl_capacity_traj_per_s`` (one core / CPU per trajectory) is also shown: what the
data layer alone would sustain.

Index growth (``control_plane_index.py``): the per-trajectory cost as the data layer's
trajectory index grows from 10^4 to 10^7 entries. 10^7 real trajectories is infeasible here,
so the index state is synthesised: that many ended tasks are entered into the ledger (what a
run that long leaves behind: their outcomes, counters, generated totals) and then a fixed
number of real trajectories are leased, written, completed and batched in-process; their
marginal data-layer CPU per trajectory and a full garbage-collection pause are measured at
each size. The store's own committed entries are not synthesised (the data layer reads only
the rows of the batches it serves).

``--max-staleness`` (2, the default config's) bounds what admission lets run ahead of the
trainer: about that many batches; with 1,000 nodes and batches of 1,024 the default leaves
most of the 8,000 slots idle, so ``--max-staleness 8 --flush-s 0.05`` shows what the control
plane itself carries.

    python benchmarks/control_plane.py [--nodes 10,100,1000] [--seconds 8] [--calls grouped,stocked]
        [--baseline-root /path/to/main] [--index-sizes 1e4,1e5,1e6,1e7] [--skip-index]

Prints tables; ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import faulthandler
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _root_from_argv() -> str:
    """``--astraflow-root`` must take effect before ``astraflow`` is imported."""
    if "--astraflow-root" in sys.argv:
        return sys.argv[sys.argv.index("--astraflow-root") + 1]
    return str(Path(__file__).resolve().parents[1])


ROOT = _root_from_argv()
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT

import psutil  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

from astraflow.dataflow.layer import DataLayer  # noqa: E402
from astraflow.transport import Link, call  # noqa: E402
from control_plane_nodes import (TEARDOWN_S, Latencies, build, emulate, gathered, layer_kwargs, loop_lag,  # noqa: E402
                                 probe, trainer_read, trainer_start)
from storage.trajectories import open_trajectory_store  # noqa: E402

QUIET = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False", "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s",
         "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "2s",
         "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "1s"}
#: ``--calls``: the call patterns each node count runs
MODES = {"per-node": ["per-node"], "grouped": ["grouped"], "stocked": ["stocked"],
         "both": ["per-node", "grouped"], "all": ["per-node", "grouped", "stocked"]}
GOALS = {"traj_per_s_1000_nodes": 10_000.0, "p99_lease_ms_1000_nodes": 20.0, "cost_growth_1e4_to_1e7": 2.0}


async def consume(dl, version: list[int], lat: Latencies, served: list[int], reader: dict) -> None:
    """A trainer that trains in no time: a batch, its rows read as a trainer reads them (in the
    trainer's own process, ``reader``), then the next version published. A checkout whose data
    layer serves complete batches (the baseline) has nothing to read."""
    v = 0
    while True:
        t0 = time.perf_counter()
        try:  # short deadlines: the benchmark's end does not wait for a long call
            batch = await call(dl.next_batch, "p", v, 3.0, timeout=30)
        except TimeoutError:  # no batch yet (``BatchTimeout`` is a ``TimeoutError``): ask again
            continue
        lat.add("next_batch", time.perf_counter() - t0)
        n = len(batch.items)
        if type(batch).__name__ == "BatchRefs":
            t0 = time.perf_counter()
            n, cpu = await asyncio.wrap_future(reader["pool"].submit(trainer_read, reader["url"], batch))
            lat.add("read", time.perf_counter() - t0)
            if lat.recording:
                reader["cpu"] += cpu
        served[0] += n
        v += 1
        t0 = time.perf_counter()
        await call(dl.published, "p", v, timeout=60)
        lat.add("published", time.perf_counter() - t0)
        version[0] = v


async def drive(dl, store, n_nodes: int, mode: str, args, pid: int, reader: dict) -> dict:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=4 * n_nodes + 32))
    lat, version, served = Latencies(), [0], [0]
    procs = min(args.emulator_procs, n_nodes)
    per_proc = -(-n_nodes // procs) if procs else n_nodes
    per_worker = max(1, min(args.nodes_per_worker, per_proc))  # a worker's nodes share a process
    opts = {k: getattr(args, k) for k in ("capacity", "episode_s", "lease_wait", "flush_s")}
    grouped = mode != "per-node"
    opts["lease_ahead"] = args.lease_ahead if mode == "stocked" else 0
    nodes, sinks, coalescers = ([], [], []) if procs else build(dl, store, 0, n_nodes, per_worker, grouped, opts,
                                                                version, lat)
    running = ([loop.create_task(n.run()) for n in nodes] + [loop.create_task(w.run()) for w in sinks]
               + [loop.create_task(loop_lag(lat)), loop.create_task(consume(dl, version, lat, served, reader))])
    # the idle caller (``probe``) and the emulator processes, each warmed up (imports done),
    # then all started together, measuring in the same window
    pools = [concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
             for _ in range(1 + procs)]
    try:
        await asyncio.gather(*(asyncio.wrap_future(pool.submit(trainer_start)) for pool in pools))
        start_at = time.time() + args.warmup
        handle = pickle.dumps(dl.current()[0])  # the actor's handle: each process makes its own Link
        probed = asyncio.wrap_future(pools[0].submit(probe, args.client.scheduler.address, handle,
                                                     start_at, args.seconds))
        emulated = [asyncio.wrap_future(pool.submit(
            emulate, args.client.scheduler.address, handle, reader["url"], k * per_proc,
            min(per_proc, n_nodes - k * per_proc), per_worker, grouped, opts, start_at, args.seconds))
            for k, pool in enumerate(pools[1:]) if k * per_proc < n_nodes]
        proc, me = psutil.Process(pid), psutil.Process()
        await asyncio.sleep(args.warmup)
        cpu0, p0, s0, t0 = sum(proc.cpu_times()[:2]), await call(dl.progress), served[0], time.perf_counter()
        me0 = sum(me.cpu_times()[:2])
        if args.profile:
            await asyncio.to_thread(args.client.run, _profile, True)
        await asyncio.to_thread(args.client.run, _gc_watch, True)
        lat.recording = True
        await asyncio.sleep(args.seconds)
        lat.recording = False
        if args.profile:
            print(next(iter((await asyncio.to_thread(args.client.run, _profile, False)).values())))
        cpu1, p1, s1, t1 = sum(proc.cpu_times()[:2]), await call(dl.progress), served[0], time.perf_counter()
        gc_seen = next(iter((await asyncio.to_thread(args.client.run, _gc_watch, False)).values()))
        me1 = sum(me.cpu_times()[:2])
        state = await call(dl.state, timeout=60)
        dead = [t for t in running if t.done() and not t.cancelled() and t.exception() is not None]
        if dead:  # an emulated node or writer that died would leave the figures quietly low
            raise RuntimeError("an emulated node, writer or the consumer failed during the run") \
                from dead[0].exception()
        gathered_counts = gathered(coalescers) if grouped else {}
        for got in await asyncio.gather(*emulated):
            for kind, xs in got["lat"].items():
                lat.by_kind.setdefault(kind, []).extend(xs)
            me1 += got["cpu_s"]
            for kind, (calls, carried) in got["gathered"].items():
                c0, c1 = gathered_counts.get(kind, (0, 0))
                gathered_counts[kind] = (c0 + calls, c1 + carried)
        lat.by_kind["probe"] = await probed
        for n in nodes:
            n.stop = True
        for t in running:
            t.cancel()
        await asyncio.wait(running, timeout=TEARDOWN_S)  # the figures are taken: a straggler does not hold them
        window = t1 - t0
        ingested = p1["sequences_generated"] - p0["sequences_generated"]
        cpu_per = (cpu1 - cpu0) / max(ingested, 1)
        batched = s1 - s0
        out = {"nodes": n_nodes, "calls": mode, "window_s": round(window, 2),
               "traj_per_s": ingested / window, "batched_seq_per_s": batched / window,
               # the emulated trainer's process: reading its batches' rows (none for the baseline)
               "trainer_read_cpu_us_per_seq": reader["cpu"] / max(batched, 1) * 1e6,
               "trainer_read_cpu_cores": reader["cpu"] / window,
               "dl_cpu_us_per_traj": cpu_per * 1e6, "dl_cpu_cores": (cpu1 - cpu0) / window,
               "dl_capacity_traj_per_s": 1.0 / cpu_per if ingested else 0.0,
               "emulator_cpu_cores": (me1 - me0) / window, "load": os.getloadavg()[0],
               # the data layer's process: garbage collections in the window, and their pauses
               "dl_gc_full": gc_seen["full"], "dl_gc_s": gc_seen["seconds"], "dl_gc_max_ms": gc_seen["max_s"] * 1e3,
               # tasks out, waiting and groups in rollout at the window's end
               "leased_now": state["leased"], "pending_now": state["pending"],
               "rolling_now": state["outstanding_groups"], "snapshots": state["snapshots"]}
        for kind in ("lease", "heartbeat", "complete", "next_batch", "read", "published", "loop_lag", "probe"):
            s = lat.summary(kind)
            out[f"{kind}_p50_ms"], out[f"{kind}_p99_ms"], out[f"{kind}_calls"] = s["p50_ms"], s["p99_ms"], s["n"]
        out["lease_empty_frac"] = lat.summary("lease_empty")["n"] / max(out["lease_calls"], 1)
        for kind, q in state.get("service_ms", {}).items():  # inside the data layer (absent in older code)
            out[f"dl_{kind}_p50_ms"], out[f"dl_{kind}_p99_ms"] = q["p50"], q["p99"]
        if grouped:
            out["gathered"] = {k: carried / max(calls, 1) for k, (calls, carried) in gathered_counts.items()}
        return out
    finally:
        for pool in pools:
            pool.shutdown(cancel_futures=True)


def _gc_watch(start: bool, dask_worker=None) -> dict:
    """On the data layer's worker: count garbage collections and their time from now, or stop
    and return {"full": full collections, "seconds": all collections, "max_s": the longest}."""
    import gc

    if start:
        seen = dask_worker._cp_gc = {"full": 0, "seconds": 0.0, "max_s": 0.0, "t0": 0.0}

        def watch(phase: str, info: dict) -> None:
            if phase == "start":
                seen["t0"] = time.perf_counter()
                return
            took = time.perf_counter() - seen["t0"]
            seen["seconds"] += took
            seen["max_s"] = max(seen["max_s"], took)
            seen["full"] += info["generation"] == 2

        dask_worker._cp_gc_cb = watch
        gc.callbacks.append(watch)
        return {}
    gc.callbacks.remove(dask_worker._cp_gc_cb)
    return {k: v for k, v in dask_worker._cp_gc.items() if k != "t0"}


def _profile(start: bool, dask_worker=None) -> str:
    """On the data layer's worker (its event loop thread, where the actor's methods run):
    start a cProfile, or stop it and return its top functions by own time."""
    import cProfile
    import io
    import pstats
    if start:
        dask_worker._cp_profiler = cProfile.Profile()
        dask_worker._cp_profiler.enable()
        return ""
    dask_worker._cp_profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(dask_worker._cp_profiler, stream=out)
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def scale_run(n_nodes: int, mode: str, lane: bool, args) -> dict:
    """One LocalCluster, one data layer (its direct lane on or off), ``n_nodes`` emulated
    nodes, one window."""
    os.environ.update({k: v for k, v in QUIET.items() if k not in os.environ})
    with tempfile.TemporaryDirectory(prefix="cp-bench-") as tmp:
        with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None,
                          host="127.0.0.1") as cluster, Client(cluster, direct_to_workers=True) as client:
            kwargs = layer_kwargs(Path(tmp), args.batch_size, args.group_size, args.prefetch, not args.no_durable,
                                  args.max_staleness, lane)
            actor = client.submit(DataLayer, actor=True, **kwargs).result()
            dl = Link(actor, "the data layer")
            pid = next(iter(client.run(os.getpid).values()))
            args.client = client
            store = open_trajectory_store(kwargs["store_url"], "a")
            # the emulated trainer's own process (spawned: no copy of this one's threads)
            pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            pool.submit(trainer_start).result(120)
            reader = {"pool": pool, "url": kwargs["store_url"], "cpu": 0.0}
            try:
                row = asyncio.run(drive(dl, store, n_nodes, mode, args, pid, reader))
                return {**row, "lane": "on" if lane else "off"}
            finally:
                pool.shutdown(cancel_futures=True)
                try:
                    actor.close().result(30)
                except Exception:
                    pass


def baseline_rows(args) -> list[dict]:
    """The per-node pattern against ``--baseline-root``'s code, in a subprocess."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--astraflow-root", args.baseline_root, "--calls", "per-node",
               "--skip-index", "--json-out", f.name, "--nodes", args.nodes, "--seconds", str(args.seconds),
               "--warmup", str(args.warmup), "--capacity", str(args.capacity), "--episode-s", str(args.episode_s),
               "--batch-size", str(args.batch_size), "--group-size", str(args.group_size),
               "--prefetch", str(args.prefetch), "--flush-s", str(args.flush_s), "--lease-wait", str(args.lease_wait),
               "--emulator-procs", str(args.emulator_procs), "--max-staleness", str(args.max_staleness)]
        cmd += ["--no-durable"] if args.no_durable else []
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": args.baseline_root})
        rows = json.loads(Path(f.name).read_text())["scale"]
    for r in rows:
        r["calls"] = "baseline"
    return rows


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print("  ".join(f"{r.get(c, ''):>16.1f}" if isinstance(r.get(c), float) else f"{str(r.get(c, '')):>16}"
                        for c in cols))


def _modes(text: str) -> list[str]:
    """``--calls``: a name of ``MODES`` or patterns separated by commas."""
    out = [m for part in text.split(",") for m in MODES.get(part.strip(), [part.strip()])]
    bad = [m for m in out if m not in MODES["all"]]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown call pattern {bad[0]!r}: use {', '.join(MODES)}")
    return out


def _end_to_end(row: dict) -> float:
    """What was both ingested and batched, per second (a trajectory is one sequence here)."""
    return min(row["traj_per_s"], row["batched_seq_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--astraflow-root", default=ROOT, help="the checkout whose astraflow is measured")
    ap.add_argument("--nodes", default="10,100,1000",
                    help="emulated RaaS node counts, comma-separated; RESULT's figures are at 1000 when measured, "
                         "else at the largest count (named in the keys)")
    ap.add_argument("--calls", default="all", type=_modes,
                    help="call patterns, comma-separated: per-node, grouped, stocked; or both (per-node,grouped), all")
    ap.add_argument("--lease-ahead", type=int, default=512, help="rollout.lease_ahead of the stocked pattern")
    ap.add_argument("--seconds", type=float, default=8.0, help="measurement window per run (after --warmup)")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds run before the window opens")
    ap.add_argument("--capacity", type=int, default=8, help="episodes in flight per emulated node")
    ap.add_argument("--episode-s", type=float, default=0.05, help="mean emulated episode time")
    ap.add_argument("--flush-s", type=float, default=0.5, help="a node writes what finished within this")
    ap.add_argument("--lease-wait", type=float, default=0.0, help="long poll of a lease call")
    ap.add_argument("--nodes-per-worker", type=int, default=50,
                    help="emulated nodes per worker (one node group: they share its calls and lease stock)")
    ap.add_argument("--emulator-procs", type=int, default=2,
                    help="the emulated nodes run in this many processes of their own, a worker's nodes "
                         "in one (0: in this process, with the consumer)")
    ap.add_argument("--batch-size", type=int, default=1024, help="sequences per batch the consumer takes")
    ap.add_argument("--group-size", type=int, default=8, help="sequences per group (one episode's)")
    ap.add_argument("--prefetch", type=int, default=4, help="dataflow.prefetch_groups")
    ap.add_argument("--max-staleness", type=int, default=2,
                    help="dataflow.max_staleness: admission lets about this many batches be in flight")
    ap.add_argument("--no-durable", action="store_true", help="no snapshot/journal (durable: false)")
    ap.add_argument("--lane", choices=("on", "off", "both"), default="on",
                    help="the data layer's direct lane (dataflow.direct_lane); both: each pattern with it off, "
                         "then on (its baseline side by side)")
    ap.add_argument("--baseline-root", default=None, help="also run the per-node pattern on this checkout")
    ap.add_argument("--index-sizes", default="1e4,1e5,1e6,1e7",
                    help="trajectory index sizes of the index-growth part, comma-separated")
    ap.add_argument("--index-trajectories", type=int, default=8000,
                    help="real trajectories measured at each index size")
    ap.add_argument("--skip-index", action="store_true", help="skip the index-growth part (scale runs only)")
    ap.add_argument("--skip-scale", action="store_true", help="skip the scale runs (index growth only)")
    ap.add_argument("--json-out", default=None, help="also write every row (scale and index) to this JSON file")
    ap.add_argument("--profile", action="store_true", help="cProfile the data layer's event loop in the window")
    args = ap.parse_args()
    # ``kill -USR1`` prints where every thread is: what a run that no longer moves waits on
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    scale: list[dict] = []
    if not args.skip_scale:
        lanes = {"on": [True], "off": [False], "both": [False, True]}[args.lane]
        for n in [int(x) for x in args.nodes.split(",")]:
            for mode in args.calls:
                for lane in lanes:
                    row = scale_run(n, mode, lane, args)
                    scale.append(row)
                    print(json.dumps(row), flush=True)
        if args.baseline_root:
            scale = baseline_rows(args) + scale
        print_table("control plane (latencies in ms, CPU in µs per trajectory)", scale,
                    ["nodes", "calls", "lane", "traj_per_s", "batched_seq_per_s", "dl_cpu_us_per_traj",
                     "dl_capacity_traj_per_s", "lease_p50_ms", "lease_p99_ms", "lease_empty_frac", "probe_p99_ms",
                     "loop_lag_p99_ms",
                     "heartbeat_p99_ms", "complete_p99_ms", "next_batch_p50_ms", "read_p50_ms", "dl_gc_full",
                     "dl_gc_max_ms",
                     "trainer_read_cpu_us_per_seq", "load"])
    index: list[dict] = []
    if not args.skip_index:
        from control_plane_index import index_growth
        index = index_growth([int(float(x)) for x in args.index_sizes.split(",")], args.index_trajectories,
                             args.batch_size, args.group_size)
        print_table("per-trajectory cost as the index grows", index,
                    ["index_entries", "dl_cpu_us_per_traj", "ingest_us_per_traj", "batch_us_per_traj",
                     "full_gc_ms", "rss_mb"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"scale": scale, "index": index}))
    result: dict = {}
    # the headline: how a node group calls by default (gathered; the lease stock is opt-in,
    # ``rollout.lease_ahead``), else the first pattern measured; the others under their names
    measured = [r["calls"] for r in scale if r["calls"] != "baseline"]  # not another checkout's
    headline = "grouped" if "grouped" in measured else (measured[0] if measured else "grouped")
    result["headline_calls"] = headline
    lane_on = [r for r in scale if r.get("lane") != "off"] or scale  # the headline: the default (lane on)
    # the figures at 1,000 nodes (the README's and the goals', keys ``*_1000_nodes``) when measured,
    # else at the largest node count measured, named in the keys instead (``traj_per_s_10_nodes``)
    counts = {r["nodes"] for r in scale}
    top = 1000 if 1000 in counts else max(counts, default=None)
    sfx = f"_{top}_nodes"
    if top is not None:
        result["nodes_measured"] = top
    best = [r for r in lane_on if r["nodes"] == top and r["calls"] == headline]
    if best:
        # end to end: what was both ingested and batched (a trajectory is one sequence here);
        # what is ingested beyond what the consumer batches ages out as stale
        result[f"traj_per_s{sfx}"] = round(_end_to_end(best[0]), 1)
        result[f"ingested_traj_per_s{sfx}"] = round(best[0]["traj_per_s"], 1)
        result[f"batched_seq_per_s{sfx}"] = round(best[0]["batched_seq_per_s"], 1)
        result[f"p99_lease_ms{sfx}"] = round(best[0]["lease_p99_ms"], 2)
        if headline == "grouped":  # a stock's refill waits in the data layer's long poll: not comparable
            result[f"p99_lease_ms_in_data_layer{sfx}"] = round(best[0].get("dl_lease_p99_ms", float("nan")), 2)
        result[f"p99_idle_caller_ms{sfx}"] = round(best[0]["probe_p99_ms"], 2)
        result[f"dl_capacity_traj_per_s{sfx}"] = round(best[0]["dl_capacity_traj_per_s"], 1)
        result[f"lease_empty_frac{sfx}"] = round(best[0]["lease_empty_frac"], 3)
    for r in scale:
        if r["nodes"] == top and not (best and r is best[0]):
            name = r["calls"] + ("_lane_off" if r.get("lane") == "off" else "")
            result[f"{name}_traj_per_s{sfx}"] = round(_end_to_end(r), 1)
            result[f"{name}_p99_lease_ms{sfx}"] = round(r["lease_p99_ms"], 2)
            result[f"{name}_dl_cpu_us_per_traj{sfx}"] = round(r["dl_cpu_us_per_traj"], 1)
    for mode in dict.fromkeys(r["calls"] for r in scale):  # the lane against its baseline, per pattern
        pair = {r.get("lane"): r for r in scale if r["nodes"] == top and r["calls"] == mode}
        if "on" in pair and "off" in pair:
            on, off = pair["on"], pair["off"]
            result[f"{mode}_traj_per_s_lane_on_vs_off"] = round(_end_to_end(on) / max(_end_to_end(off), 1e-9), 3)
            result[f"{mode}_p99_lease_lane_on_vs_off"] = round(on["lease_p99_ms"] / max(off["lease_p99_ms"], 1e-9), 3)
            result[f"{mode}_dl_cpu_per_traj_lane_on_vs_off"] = round(
                on["dl_cpu_us_per_traj"] / max(off["dl_cpu_us_per_traj"], 1e-9), 3)
    if f"stocked_p99_lease_ms{sfx}" in result and f"p99_lease_ms{sfx}" in result and headline == "grouped":
        result["p99_lease_stocked_vs_grouped"] = round(
            result[f"stocked_p99_lease_ms{sfx}"] / max(result[f"p99_lease_ms{sfx}"], 1e-9), 3)
    if len(index) > 1:
        result["cost_growth_1e4_to_1e7"] = round(index[-1]["dl_cpu_us_per_traj"] / index[0]["dl_cpu_us_per_traj"], 2)
        result["index_range"] = [index[0]["index_entries"], index[-1]["index_entries"]]
    for key, goal in GOALS.items():
        if key in result:
            result[f"{key}_vs_goal"] = round(result[key] / goal, 3)
    result["load"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
