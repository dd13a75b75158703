"""Runtime room: the models a run starts from. Each policy's missing model directory is built
from its ``init`` (a random initialisation or a copy of an earlier policy's model, then an
optional supervised warm start), once even when runs start together, and recorded so a later
config with another ``init`` is refused rather than trained on it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path

from astraflow.agents.workload import is_agentic
from astraflow.config import RunConfig
from astraflow.preflight import check_built_from_init
from astraflow.runtime.progress import Progress
from astraflow.runtime.stopping import disk_full
from astraflow.training.config import ModelInit
from astraflow.workloads.base import make_workload, workload_class
from astraflow.workloads.config import WorkloadConfig
from astraflow.workloads.split import evaluated


class ModelDirError(ValueError):
    """The directory a model is to be built into cannot be created."""


class BuiltMeanwhile(ModelDirError):
    """The model directory was filled (by another build) while this build ran; left as it is."""


def build_model(out: Path, init: ModelInit, workload: WorkloadConfig | None = None,
                progress: Progress | None = None, base: Path | None = None, record: dict | None = None,
                threads: int = 1) -> Path:
    """Build a model directory locally: random init (or a copy of the ``base`` model
    directory, ``init.start_from``'s), then an optional supervised warm start on the
    workload's train split, on ``threads`` torch threads (a run passes its trainer's: torch's
    default of every core spins its threads against each other on a busy machine). Written to
    a temporary sibling and renamed, so an interrupted build never leaves a half-written model
    behind. ``record``: the init record (`record_init`) written before the rename, so that a
    run finding the directory finds it with its record."""
    from astraflow.models import init_model, record_init

    progress = progress or Progress()
    out = Path(out)
    tmp = _temp_sibling(out)
    try:
        if base is not None:
            shutil.copytree(base, tmp / "init")
        else:
            tokenizer = None
            if init.tokenizer == "bpe":
                with progress.waiting(f"training a {init.vocab_size}-token BPE tokenizer on the train split"):
                    tokenizer = bpe_for(workload, init.vocab_size)
            with progress.waiting(f"initialising a {init.preset} {init.arch} model"):
                init_model(tmp / "init", preset=init.preset, arch=init.arch, seed=init.seed,
                           tie_word_embeddings=init.tie_embeddings, tokenizer=tokenizer)
        if init.warm_starts:
            with torch_threads(threads):
                _warm_start(tmp / "init", tmp / "final", init, workload, progress, out)
            shutil.rmtree(tmp / "init")
            (tmp / "final").rename(tmp / "init")
        if record is not None:  # also replaces a start_from base's record
            record_init(tmp / "init", record)
        try:
            (tmp / "init").rename(out)  # over an empty directory only (``init-model``'s OUT)
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise BuiltMeanwhile(f"{out} was filled while this model was built (by another build?); it is "
                                "left as it is: remove it to build it again, or use it") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` in the block, then back to what they were."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _temp_sibling(out: Path) -> Path:
    """A fresh temporary directory beside ``out``; a path that cannot be created (under a file,
    read-only) is a `ModelDirError` naming the fix, a full disk raised as it is."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as err:
        raise _unbuildable(out, err) from None


def _unbuildable(out: Path, err: OSError) -> OSError:
    """What to raise for ``err`` making a place for model ``out``: a full disk as it is (not the
    path's fault: it ends a run the one way it always does), else a `ModelDirError` naming the fix."""
    if disk_full(err):
        return err
    where = f" ({err.filename})" if err.filename else ""
    return ModelDirError(f"{out} cannot be created: {err.strerror or err}{where}; choose a directory "
                         "that can be created")


@contextlib.contextmanager
def building(out: Path, progress: Progress):
    """Held while model ``out`` is looked for and built: an ``flock`` on ``.<name>.build.lock``
    beside it, so that runs started together build a missing model once (the later ones wait,
    then find it built) and none replaces the directory another has started from. Where no
    lock can be had (a file system without locks, another user's lock file) the build goes on
    unguarded, as before there was one."""
    lock = out.parent / f".{out.name}.build.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except PermissionError:
        if not lock.exists():
            raise _unbuildable(out, PermissionError(errno.EACCES, "Permission denied", str(out.parent))) from None
        fd = None  # another user's lock file: unguarded
    except OSError as err:
        raise _unbuildable(out, err) from None
    try:
        if fd is not None:
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    with progress.waiting(f"waiting for another run that is building {out}"):
                        fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as err:  # a file system without locks (NFS nolock, Lustre noflock)
                progress.note(f"building {out} without a lock ({err}): runs started together may build it twice")
            else:
                _remove_leftovers(out, progress)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _remove_leftovers(out: Path, progress: Progress) -> None:
    """Remove the temporary siblings (``_temp_sibling``) of builds of ``out`` that were killed
    before their ``finally`` ran. Called with the build lock held: no build of ``out`` is live."""
    for path in out.parent.glob(f".{glob.escape(out.name)}.*"):
        if len(path.name) == len(out.name) + 10 and path.is_dir() and not path.is_symlink():
            progress.note(f"removing {path}, left by an interrupted build of {out}")
            shutil.rmtree(path, ignore_errors=True)


def _warm_start(src: Path, dst: Path, init: ModelInit, workload: WorkloadConfig | None, progress: Progress,
                model: Path) -> None:
    """The supervised warm start from ``src`` into ``dst`` (to become ``model``), on what the
    workload offers: expert demonstrations (agentic workloads), reference solutions (workloads
    with demonstrations; the hidden tests for ``init.task: test``), or generated problems (math).
    One that ends at its bound short of ``warm_start_target`` says so: the run then starts RL
    from a weaker policy than its config intends, and the model is kept for later runs."""
    params = dict((workload.params if workload else {}) or {})
    bounds = [f"{init.warm_start_seconds:.0f}s"] if init.warm_start_seconds > 0 else []
    bounds += [f"{init.warm_start_steps} steps"] if init.warm_start_steps is not None else []
    common = dict(seconds=init.warm_start_seconds or None, steps=init.warm_start_steps,
                  lr=init.warm_start_lr, seed=init.seed, progress=progress.enabled,
                  target_acc=init.warm_start_target,
                  eval_every=25 if init.warm_start_target is not None else 50,
                  # shown in the heartbeat lines of a log ("still supervised warm start ...")
                  on_eval=lambda r: progress.detail(f"step {r['step']}, held-out accuracy {r['acc']:.2f}"))
    agentic = workload is not None and is_agentic(workload_class(workload.name))
    demos = (workload is not None and workload.name != "math" and not agentic
             and hasattr(workload_class(workload.name), "demonstration"))
    what = ("expert demonstrations" if agentic else "tests from the hidden tests" if init.task == "test"
            else "reference solutions" if demos else init.task)
    # its stopping rule in full: a target usually ends it long before its bound in steps
    measure = "success" if agentic else "accuracy"
    rule = ([f"for up to {' or '.join(bounds)}"] if bounds else []) + (
        [f"until held-out {measure} {init.warm_start_target}"] if init.warm_start_target is not None else [])
    # the warm start draws its own progress bar
    with progress.waiting(f"supervised warm start ({what}) {', '.join(rule)}", live=False):
        if agentic:
            from astraflow.training.agent_warmstart import agent_warm_start

            wl = make_workload(workload.name, params, workload.seed)
            result = agent_warm_start(src, dst, wl, demo_noise=init.demo_noise,
                                      max_new_tokens=workload.sampling.max_new_tokens, **common)
        elif demos:
            from astraflow.training.demo_warmstart import demo_warm_start

            wl = make_workload(workload.name, params, workload.seed)
            max_new = workload.sampling.max_new_tokens
            if init.task == "test":  # the tester of solver_testgen: its prompts and suites
                from astraflow.workloads.testgen import SUITE_NEW_TOKENS, TesterView

                wl, max_new = TesterView(wl), SUITE_NEW_TOKENS
            result = demo_warm_start(src, dst, wl, max_new_tokens=max_new, label=what, **common)
        else:
            from astraflow.training.warmstart import warm_start

            # the run's workload.seed splits its problems: the warm start must train on that train split
            seeded_params = {"seed": workload.seed, **params} if workload else params
            result = warm_start(src, dst, workload=seeded_params, task=init.task, **common)
    progress.note(f"warm start ({what}): {result['steps']} steps, "
                  f"held-out {measure} {result['acc']:.3f}")
    target = init.warm_start_target
    if target is not None and result["acc"] < target:
        progress.note(f"warning: the warm start reached its bound ({' or '.join(bounds)}) at held-out "
                      f"{result['acc']:.3f}, short of its target {target}: RL starts from a weaker policy than "
                      f"the config intends. To build it again, remove {model} and raise "
                      "init.warm_start_steps (or warm_start_seconds)")


def workload_identity(workload: WorkloadConfig | None) -> dict | None:
    """What decides a workload's problems and their split: its name, params and seed (a seed the
    params set wins, as ``make_workload`` takes it)."""
    if workload is None:
        return None
    params = workload.model_dump(mode="json")["params"] or {}
    return {"name": workload.name, "params": {k: v for k, v in params.items() if k != "seed"},
            "seed": params.get("seed", workload.seed)}


def held_out_trained_on(model: Path, init: ModelInit | None, workload: WorkloadConfig | None) -> str | None:
    """Where ``model``'s warm start trained on other problems than ``workload``'s and some of
    ``workload``'s held-out prompts were among them: how many, and what differs (a model built
    before the record names its workload and warm-started on math took seed 0's split); else None.
    A recorded workload that cannot be built again (its files moved) is not compared."""
    from astraflow.models import WARM_STARTED_ON, recorded_init

    record, ours = recorded_init(model) or {}, workload_identity(workload)
    then = record.get(WARM_STARTED_ON)
    if then is None and init is not None and init.warm_starts and ours and ours["name"] == "math":
        then = {**ours, "seed": 0}  # what such a build trained on, whatever the run's seed
    if not isinstance(then, dict) or ours is None or then == ours:
        return None
    try:
        before = make_workload(then["name"], {**then["params"], "seed": then["seed"]}, then["seed"])
        now = make_workload(workload.name, dict(workload.params or {}), workload.seed)
        trained = {before.render_prompt(p) for p in before.tasks("train")}
        held_out = [now.render_prompt(p) for p in evaluated(now.tasks("eval"), workload.eval.num_prompts)]
    except Exception:
        return None
    seen = sum(p in trained for p in held_out)
    if not seen:
        return None
    differs = {k: then.get(k) for k in ours if then.get(k) != ours[k]}
    return f"{seen} of its {len(held_out)} held-out prompts (warm-started on {then['name']} {json.dumps(differs)})"


#: expert episodes a BPE tokenizer of an agentic workload is trained on (plenty for its merges)
BPE_AGENT_EPISODES = 2000


def bpe_for(workload: WorkloadConfig | None, vocab_size: int):
    """A BPE tokenizer trained on ``workload``'s train split: each prompt as plain text and its
    demonstration (reference solution) where the workload has one; for an agentic workload, its
    expert's episodes (observations, tool results and turns)."""
    from astraflow.models import build_bpe_tokenizer

    if workload is None:
        raise ValueError("init.tokenizer: bpe trains on the workload's train split; the config has no workload")
    wl = make_workload(workload.name, dict(workload.params or {}), workload.seed)
    if is_agentic(type(wl)):
        from astraflow.agents.demos import demonstration_texts
        from astraflow.models import build_tokenizer

        corpus = wl.tasks("train")[:BPE_AGENT_EPISODES]
        return build_bpe_tokenizer(demonstration_texts(wl, corpus, build_tokenizer()), vocab_size)
    demo = getattr(wl, "demonstration", None)
    texts = [wl.render_prompt(p) + (demo(p) if demo is not None else "") for p in wl.tasks("train")]
    if workload.workflow == "solver_testgen":  # the tester's prompts and suites share the tokenizer
        from astraflow.workloads.testgen import TesterView, hidden_asserts

        view = TesterView(wl)
        texts += [view.render_prompt(p) + "\n".join(hidden_asserts(p)) for p in wl.tasks("train")]
    return build_bpe_tokenizer(texts, vocab_size)


def prepare_models(cfg: RunConfig, progress: Progress) -> None:
    """Build each policy's missing model directory from its ``init`` and record that init in it
    (``INIT_RECORD``: a later config whose ``init`` differs is refused, not silently trained on
    this model). An existing directory is used as it is; one that records no init, where the
    policy has an ``init``, is said to be (its ``init`` then builds nothing), and one whose warm
    start trained on some of the run's held-out prompts is warned about (``held_out_trained_on``)."""
    from astraflow.models import WARM_STARTED_ON, recorded_init
    from astraflow.sandbox import configure

    configure(cfg.sandbox)  # a warm start's held-out checks score with the run's sandbox limits
    for pol in cfg.policies:
        if cfg.simulated(pol):
            continue
        if pol.model.exists():
            check_built_from_init(pol)  # built since the config was checked (another run) counts too
            if pol.init is not None and recorded_init(pol.model) is None:
                progress.note(f"policy {pol.name}: {pol.model} exists and records no init it was built from, so "
                              "its init builds nothing (remove the directory to build the model from init)")
            if (leak := held_out_trained_on(pol.model, pol.init, cfg.workload)) is not None:
                progress.note(f"warning: policy {pol.name}: the warm start of {pol.model} trained on {leak}: the "
                              "run's held-out accuracy counts problems the model was taught. Vary run.seed (not "
                              "workload.seed) to repeat a run on the same held-out problems, or remove the "
                              "directory to build the model for this workload")
            continue
        assert pol.init is not None, "config validation requires init for a missing model"
        base = cfg.policy(pol.init.start_from).model if pol.init.start_from else None
        try:
            with building(pol.model, progress):
                if pol.model.exists():  # another run built it while this one waited: checked as any other
                    check_built_from_init(pol)
                    progress.note(f"policy {pol.name}: {pol.model} was built by another run meanwhile")
                    continue
                progress.note(f"policy {pol.name}: building {pol.model} (no such directory yet)"
                              + (f" from {base}" if base else ""))
                record = pol.init.model_dump(mode="json")
                if pol.init.warm_starts:  # what it trained on: a later run on other problems is warned
                    record[WARM_STARTED_ON] = workload_identity(cfg.workload)
                try:
                    build_model(pol.model, pol.init, cfg.workload, progress, base=base, record=record,
                                threads=pol.trainer.threads)
                except BuiltMeanwhile:  # unguarded (no locks): another run's build finished first
                    check_built_from_init(pol)
                    progress.note(f"policy {pol.name}: {pol.model} was built by another run meanwhile")
        except ModelDirError as err:
            raise ModelDirError(f"policies[{pol.name}].model: {err}") from None
