"""Runtime room: ``astraflow run``. Check the data and the run directory, prepare the models a
config names (``model_build``), then hand over to the orchestrator."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from astraflow.clibase import shell_arg
from astraflow.config import RunConfig
from astraflow.context_fit import prompts_that_do_not_fit
from astraflow.preflight import check_network, eval_split_lines, held_out_overlap, models_that_never_stop
from astraflow.runtime.jobrecords import PreviousJobs, cancel_previous_jobs
from astraflow.runtime.model_build import prepare_models
from astraflow.runtime.orchestrator import Orchestrator, RunResult
from astraflow.runtime.progress import Progress, accuracy_changes
from astraflow.runtime.reconcile import local_fork_server
from astraflow.runtime.resume_checks import check_resumable, check_same_models
from astraflow.runtime.resuming import resume_note
from astraflow.runtime.runlock import RunDirLock
from astraflow.runtime.stopping import REQUEUE_SIGNAL, STOPPING, StopForRequeue
from astraflow.workloads.base import make_workload
from astraflow.workloads.config import WorkloadConfig
from storage.paths import RunPaths


def check_data(workload: WorkloadConfig, cfg: RunConfig | None = None) -> str:
    """Read the workload's train and held-out splits as a run will: one line of what was found
    (with the bad rows of a dataset, by location), a line when ``workload.eval.num_prompts`` asks
    for more held-out prompts than there are (each evaluation takes them all), and with ``cfg`` a
    line per policy whose model cannot take some of the prompts (``prompts_that_do_not_fit``).
    ``ValueError`` naming the fix when the train split is empty, evaluations are asked for
    (``workload.eval.every``) of an empty held-out split, no train prompt fits, or the data
    cannot be read."""
    wl = make_workload(workload.name, dict(workload.params or {}), workload.seed)
    train = _split(wl, workload.name, "train")
    n_train = len(train)
    held_out = _split(wl, workload.name, "eval")
    n_eval = len(held_out)
    if n_train == 0:
        from astraflow.dataflow.mixing import empty_train_split

        raise ValueError(empty_train_split(workload.name, workload.params))
    lines = eval_split_lines(workload, held_out) + held_out_overlap(train, held_out)
    report = getattr(wl, "report", None)
    found = f"workload {workload.name}: {n_train} train and {n_eval} held-out prompts"
    said = report is not None and (report.bad or report.other_splits)
    lines.insert(0, f"{found}; {report.summary()}" if said else found)
    if cfg is not None:
        lines += prompts_that_do_not_fit(cfg, wl) + models_that_never_stop(cfg)
        self_check = getattr(wl, "self_check", None)  # a workload that can test its own data (its references)
        if callable(self_check) and not cfg.simulated(cfg.policies[0]):
            from astraflow.sandbox import configure

            configure(cfg.sandbox)
            lines += self_check()
    return "\n".join(lines)


def _split(wl, name: str, split: str) -> list:
    """``wl.tasks(split)``; a workload's own error other than the ``ValueError`` that names its
    fix becomes one naming the method (a user's workload: a traceback says less)."""
    try:
        return wl.tasks(split)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"workload {name}: tasks({split!r}) raised {type(err).__name__}: {err}; fix the "
                         f"workload's tasks() (`astraflow check CONFIG` runs it without starting anything)") from err


def head_logging() -> None:
    """The head's log lines on its stderr: warnings and worse, less what `_drop_unwaited_timeouts` drops,
    each with its time and where it comes from, as the progress lines beside them read."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    asyncio_log = logging.getLogger("asyncio")
    if _drop_unwaited_timeouts not in asyncio_log.filters:
        asyncio_log.addFilter(_drop_unwaited_timeouts)


def _drop_unwaited_timeouts(record: logging.LogRecord) -> bool:
    """False for asyncio's report of a timeout nobody waited for: Dask's client leaves one behind
    when its connection's sender is torn down mid-wait on the way out (a run that fails must
    print its one line, not three of asyncio's). Every other exception it reports still shows."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, TimeoutError) and str(record.msg).startswith("Future exception was never retrieved"))


def _signals_stop_cleanly() -> None:
    """SIGTERM (``scancel`` of a head job, ``kill``) takes the Ctrl-C path: a stop bounded by
    ``cluster.stop_grace_s`` that flushes the nodes, closes the ledger, writes the summary and
    cancels the worker jobs (those of them the signal also reached are skipped). The requeue
    signal (SIGUSR1, the head job's warning before its walltime) takes the same path as
    `StopForRequeue`: the summary says ``requeue`` and the CLI exits with `REQUEUE_EXIT_CODE`."""
    if threading.current_thread() is not threading.main_thread():
        return
    STOPPING.clear()

    def handler(signum, frame):
        if STOPPING.is_set():  # a second Ctrl-C, or one during any run's stop: it must not break it
            with contextlib.suppress(OSError):  # a terminal that closed
                sys.stderr.write(f"already stopping ({signal_name(signum)} ignored): the components get "
                                 "cluster.stop_grace_s, then the summary is written and the jobs cancelled\n")
            return
        STOPPING.set()
        raise (StopForRequeue if signum == REQUEUE_SIGNAL else KeyboardInterrupt)(signal_name(signum))

    signal.signal(signal.SIGTERM, handler)
    signal.signal(REQUEUE_SIGNAL, handler)
    # the terminal or SSH session closed: by default the process would die at once, leaving no
    # summary and its worker jobs running (under nohup it is ignored, as asked)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, handler)
    # a run started in the background by a non-interactive shell inherits SIGINT ignored;
    # `kill -INT` (and Ctrl-C) must still stop it cleanly
    signal.signal(signal.SIGINT, handler)


#: what a stop calls the signals users know by another name
_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C or `astraflow stop`)",
                 signal.SIGHUP: "SIGHUP (its terminal closed; a run that must outlive its terminal is started "
                                "under sbatch, tmux or nohup)"}


def signal_name(signum: int) -> str:
    """``SIGTERM``, ``SIGINT (Ctrl-C)``, ...: what the stop's reason names."""
    try:
        return _SIGNAL_NAMES.get(signum) or signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def check_sandbox(cfg: RunConfig) -> None:
    """A workload whose rewards run programs needs a working sandbox on this machine: a
    ValueError naming the fix before anything starts, not a failed reward per episode."""
    # built (cheap: workloads make their tasks lazily): a mixture uses it when one of its sources does
    if not getattr(make_workload(cfg.workload.name, cfg.workload.params, cfg.workload.seed), "uses_sandbox", False):
        return
    from astraflow.sandbox import Sandbox, SandboxUnavailable

    try:
        Sandbox(cfg.sandbox).check()
    except SandboxUnavailable as err:
        raise ValueError(f"sandbox: {err}") from None


def check_environment_of(cfg: RunConfig, say: Callable[[str], None] = lambda line: None) -> str | None:
    """An agentic workload's environment run through the conformance suite (scripted turns in
    place of a model, tokenised as the run's first policy will tokenise them; ``say`` is told
    first): a line saying it conforms, a ValueError listing what does not, ``None`` for a
    workload without an environment."""
    from astraflow.agents.workload import is_agentic
    from astraflow.workloads.base import workload_class

    if not is_agentic(workload_class(cfg.workload.name)):
        return None
    from astraflow.agents.conformance import check_environment

    say(f"workload {cfg.workload.name}: running its environment through the conformance suite")
    wl = make_workload(cfg.workload.name, dict(cfg.workload.params or {}), cfg.workload.seed)
    problems = check_environment(wl, max_new_tokens=cfg.workload.sampling.max_new_tokens, tokenizer=_run_tokenizer(cfg))
    if problems:
        raise ValueError(f"workload {cfg.workload.name}: its environment does not conform (the conformance "
                         "suite, docs/agents.md):\n  - " + "\n  - ".join(problems))
    return f"workload {cfg.workload.name}: its environment conforms (scripted episodes on tasks of both splits)"


def _run_tokenizer(cfg: RunConfig):
    """The tokenizer the first policy's model has, or will have once its ``init`` builds it (a BPE
    one is trained as the build trains it); ``None`` for the default byte-level one, or where the
    model cannot be read (the model check names why)."""
    from astraflow.model_loading import load_tokenizer

    pol = next((p for p in cfg.policies if not cfg.simulated(p)), None)
    while pol is not None:
        if pol.model.exists():
            try:
                return load_tokenizer(pol.model)
            except (OSError, ValueError):
                return None
        if pol.init is None or not pol.init.start_from:
            break
        pol = cfg.policy(pol.init.start_from)  # built from an earlier policy's model: its tokenizer
    if pol is None:
        return None
    if pol.init is not None and pol.init.tokenizer == "bpe":
        from astraflow.runtime.model_build import bpe_for

        return bpe_for(cfg.workload, pol.init.vocab_size)
    return None


def forget_durable_state(cfg: RunConfig, run_dir: Path, progress: Progress) -> None:
    """With ``dataflow.durable: false`` the data layer's snapshot and change log are no longer
    kept up to date: ones an earlier incarnation left are removed (with the run directory
    locked), or a later durable resume would go back to them, behind the versions trained since."""
    from astraflow.dataflow.changelog import log_numbers, log_path

    snapshot = RunPaths(run_dir).dataflow_snapshot
    if cfg.dataflow.durable or not snapshot.exists():
        return
    for n in log_numbers(snapshot):
        log_path(snapshot, n).unlink(missing_ok=True)
    snapshot.unlink(missing_ok=True)
    progress.note(f"dataflow.durable is false: removed the data layer's earlier snapshot {snapshot}")


def cancel_leftovers(cfg: RunConfig, lock: RunDirLock, progress: Progress) -> PreviousJobs:
    """Cancel the worker jobs a previous incarnation of the run left active (`jobrecords`), only
    while ``lock`` is held: without it a live run might own them (a filesystem without locks)."""
    if not lock.held:
        progress.note("not checking for jobs left by a previous incarnation: the run directory is not locked")
        return PreviousJobs()
    return cancel_previous_jobs(lock.paths, cfg.cluster, cfg.partitions, progress)


def already_done(cfg: RunConfig, run_dir: Path) -> str | None:
    """What to say instead of starting, when the run in ``run_dir`` completed and every policy has
    committed ``run.max_steps`` (running again would start every process for nothing); else None."""
    from storage.weights import WeightStore

    paths = RunPaths(run_dir)
    try:
        ended = json.loads(paths.summary.read_text()).get("status") if paths.summary.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    if ended != "completed" or not paths.weights.is_dir():
        return None
    store = WeightStore(paths.weights)
    at = {p.name: max(store.versions(p.name), default=-1) for p in cfg.policies}
    if min(at.values()) < cfg.run.max_steps:
        return None
    reached = ", ".join(f"{p} v{v}" for p, v in at.items())
    return (f"the run in {run_dir} has completed already ({reached}; run.max_steps {cfg.run.max_steps}): nothing "
            f"to do. Raise run.max_steps (--set run.max_steps=N) to train it further; its summary is {paths.summary}")


def launch(cfg: RunConfig, run_dir: Path, quiet: bool = False) -> RunResult | None:
    """Run ``cfg`` in ``run_dir``. The directory's lock is held from before any model is built or
    process started until the run ends (``RunDirError`` when another run holds it); the data is
    read before, so a bad dataset leaves no run directory behind. With the lock held, the jobs
    a previous incarnation left are cancelled before anything starts. None: the run had completed
    already (``already_done``), and nothing was started."""
    head_logging()
    _signals_stop_cleanly()
    if quiet:  # transformers' and the hub's own bars too (writing a model built here)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    progress = Progress(enabled=not quiet)
    read_from = time.monotonic()
    with progress.waiting(f"reading the data of workload {cfg.workload.name}"):
        found = check_data(cfg.workload, cfg)
    data_read_s = time.monotonic() - read_from  # the data layer reads it again: its placement deadline
    progress.note(found)
    check_sandbox(cfg)
    check_network(cfg)  # the addresses it binds here, before a scheduler or worker fails on one
    with RunDirLock(run_dir) as lock:
        previous = cancel_leftovers(cfg, lock, progress)  # also when the resume is refused: they are left over
        check_resumable(cfg, run_dir)
        done = already_done(cfg, run_dir)
        if done is not None:
            progress.note(done)
            return None
        for line in resume_note(cfg, run_dir):
            progress.note(line)
        forget_durable_state(cfg, run_dir, progress)
        server = local_fork_server(RunPaths(run_dir), cfg.cluster, list(cfg.partitions))
        try:
            missing = [p.name for p in cfg.policies if not p.model.exists() and not cfg.simulated(p)]
            prepare_models(cfg, progress)
            if missing:  # the prompts against the models init built just now
                wl = make_workload(cfg.workload.name, dict(cfg.workload.params or {}), cfg.workload.seed)
                for line in prompts_that_do_not_fit(cfg, wl, missing):
                    progress.note(line)
            check_same_models(cfg, run_dir)
            progress.note(f"run directory {run_dir}")
            result = Orchestrator(cfg, run_dir, progress, previous, server, data_read_s).run()
        finally:
            if server is not None:  # the run's local scheduler closed it already, unless none was made
                server.close()
    for line in accuracy_changes(result.eval):
        progress.note(line)
    progress.note(f"ledger: {result.ledger.get('states') or 'no task created'}; summary in {RunPaths(run_dir).summary}")
    if not result.interrupted:
        for line in export_hints(cfg, run_dir):
            progress.note(line)
    progress.note(f"what the policies wrote, episode by episode: astraflow episodes {shell_arg(run_dir)}")
    failed = failure_reasons(result.ledger)
    if failed:
        progress.note(f"failed tasks by reason: {failed} (the tracebacks are in the RaaS nodes' logs under "
                      f"{RunPaths(run_dir).jobs})")
    return result


def export_hints(cfg: RunConfig, run_dir: Path) -> list[str]:
    """The ``astraflow export`` command of each trained policy: with ``--policy`` where the run
    trains several (export refuses to guess), none for a sim policy (it has no weights)."""
    real = [p.name for p in cfg.policies if p.trainer.backend != "sim"]
    if len(cfg.policies) == 1:
        return [f"the trained model as an HF directory: astraflow export {shell_arg(run_dir)} OUT"] if real else []
    return [f"the trained {name} as an HF directory: astraflow export {shell_arg(run_dir)} OUT --policy {name}"
            for name in real]


def failure_reasons(ledger: dict, most: int = 3, width: int = 240) -> str:
    """The commonest reasons rollout tasks failed (``Ledger.summary``), one line: ``""`` when none did."""
    by_reason = sorted((ledger.get("failed_by_reason") or {}).items(), key=lambda kv: -kv[1])
    said = "; ".join(f"{n}x {why if len(why) <= width else why[:width - 3] + '...'}" for why, n in by_reason[:most])
    more = len(by_reason) - most
    return said + (f"; and {more} other reason{'s' if more > 1 else ''}" if more > 0 else "")
