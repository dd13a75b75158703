"""Where a benchmark's CPU time goes: the cores each process of its tree kept busy (by role),
and a sampling profile of one worker process's threads (``client.run``: the functions travel
by value, the worker need not import this file)."""

from __future__ import annotations

import json


def _role(proc, me, known: dict[int, str]) -> str:
    """What a process of this benchmark's tree is: the benchmark itself, a worker (``known``:
    pid -> role; Dask retitles its processes), the Dask scheduler, one of vLLM's processes (by
    title), or else the start of its command line."""
    import psutil

    if proc.pid == me.pid:
        return "benchmark process"  # the bare path's: the engine's client
    if proc.pid in known:
        return known[proc.pid]
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if "EngineCore" in cmd:
        return "vLLM engine core"
    if "VLLM" in cmd:
        return "vLLM worker"
    if "dask_scheduler" in cmd or cmd.startswith("dask scheduler"):
        return "Dask scheduler"
    if "spawn_main" in cmd:
        return "engine process"  # the HF engine's own process (rollout.engine.process)
    return f"other ({cmd[:30]})"


def process_cpu(known: dict[int, str] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and its descendants, summed by
    ``_role``, and of the whole machine (``machine``, every process of every user)."""
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        role = _role(proc, me, known or {})
        out[role] = out.get(role, 0.0) + t.user + t.system
    m = psutil.cpu_times()
    out["machine"] = m.user + m.nice + m.system + m.irq + m.softirq
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Cores each role kept busy between two ``process_cpu`` readings (CPU seconds / wall)."""
    return {k: round((after[k] - before.get(k, 0.0)) / wall, 3) for k in after}


def start_sampler(interval: float = 0.005) -> None:
    """In a worker process (``client.run``): sample every thread's Python stack every
    ``interval`` seconds while it is running (state R in ``/proc``), and read every thread's
    CPU time, until ``stop_sampler``."""
    import collections
    import os
    import sys
    import threading

    import psutil

    state = {"stop": threading.Event(), "self": collections.Counter(), "cum": collections.Counter(),
             "samples": collections.Counter(), "cpu0": {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}}

    def running(tid: int) -> bool:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:
            return False

    def loop() -> None:
        me = threading.get_native_id()
        native = {}
        while not state["stop"].wait(interval):
            for t in threading.enumerate():
                if t.native_id is not None:
                    native[t.ident] = (t.native_id, t.name)
            for ident, frame in sys._current_frames().items():
                tid, name = native.get(ident, (None, "?"))
                if tid is None or tid == me or not running(tid):
                    continue
                state["samples"][name] += 1
                seen, first = set(), True
                while frame is not None:
                    code = frame.f_code
                    key = f"{name}: {os.path.basename(code.co_filename)}:{code.co_name}"
                    if first:
                        state["self"][key] += 1
                        first = False
                    if key not in seen:
                        state["cum"][key] += 1
                        seen.add(key)
                    frame = frame.f_back

    threading.Thread(target=loop, name="bench-sampler", daemon=True).start()
    sys._bench_sampler = state  # a function sent by value gets fresh globals: keep the state on a module


def stop_sampler(top: int = 25) -> dict:
    """The sampler's result: CPU seconds per thread (by name) since ``start_sampler`` and the
    ``top`` functions by running samples, self and cumulative."""
    import sys
    import threading

    import psutil

    state = sys.__dict__.pop("_bench_sampler")
    state["stop"].set()
    names = {t.native_id: t.name for t in threading.enumerate()}
    cpu: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, f"native {t.id}")
        cpu[name] = cpu.get(name, 0.0) + t.user_time + t.system_time - state["cpu0"].get(t.id, 0.0)
    return {"thread_cpu_s": dict(sorted(cpu.items(), key=lambda kv: -kv[1])), "samples": dict(state["samples"]),
            "self": state["self"].most_common(top), "cum": state["cum"].most_common(top)}


def print_profile(prof: dict, wall: float) -> None:
    """The rollout worker's threads: cores each kept busy, and where the running samples were."""
    print(f"rollout worker process, {wall:.1f} s: cores per thread "
          + ", ".join(f"{k} {v / wall:.3f}" for k, v in prof["thread_cpu_s"].items() if v > 0.01 * wall))
    print("running samples per thread: " + json.dumps(prof["samples"]))
    for kind in ("self", "cum"):
        print(f"top functions ({kind}, running samples):")
        for key, count in prof[kind]:
            print(f"  {count:6d}  {key}")
