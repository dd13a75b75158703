"""``astraflow plan``: a user's config simulated on pools of hardware, then the pool sizes at
which the trainer stops waiting.

Where the simulated run's numbers come from (first that applies):

* trainer step time: ``--step-seconds``; when its trainers are sim already, the config's
  ``sim_step_seconds`` plus ``sim_seconds_per_token`` x batch size x mean response tokens, times
  its engines' ``time_scale`` (a ``sim_step_schedule`` is left out: the simulated trainer takes
  the one step time reported); the calibration's measured step (``--calibrate``); else derived,
  ``6 * parameters * tokens per step`` FLOPs on the ``--trainer`` GPUs at ``TRAINER_MFU`` of
  their peak (parameters from ``--model-params`` or the model directory's ``config.json``;
  tokens per step = batch size x (prompt + mean response tokens));
* mean response length: ``--response-tokens``; the calibration's measured mean; the config's
  ``rollout.engine.sim.length_mean`` for a sim engine; else half of ``max_new_tokens``;
* prompt length: ``--prompt-tokens``; the calibration's; the sim workload's ``prompt_tokens``;
  else ``DEFAULT_PROMPT_TOKENS``;
* time scale: ``--time-scale``, else a real trainer step of at least ``REAL_STEP_S`` (the
  control plane's own latency per step, a floor under the wait, stays small against it) and at
  most ``REAL_RATE`` trajectories a real second (what this machine's control plane keeps up
  with), whichever is slower; but at least fast enough that the engines' timeline from a weight
  version to a sample of it (``pools.engine_seconds``) takes at most ``REAL_ENGINE_S`` real
  seconds, since below scale 1 it stretches in real time as the trainer's step does. Where that
  leaves a real trainer step under ``MIN_REAL_STEP_S`` (a trainer far faster than the engines'
  timeline), the plan is refused naming ``--step-seconds`` / ``--time-scale``.

A run is at most ``MAX_MINUTES`` simulated minutes and ``MAX_STEPS`` steps (steady rates come
within minutes; more only costs real time).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from astraflow.config import ConfigError, RunConfig, config_from_dict
from astraflow.plan.pools import (MAX_NODES, Pool, PlanError, SimShape, derived_step_seconds, engine_seconds,
                                  ignored_sim_settings, sim_config, simulated_factor)
from astraflow.plan.search import SearchResult, find_scale
from astraflow.plan.simulate import SimFailed, SimResult, run_sim
from astraflow.rollout.sim_config import HardwareProfile

DEFAULT_PROMPT_TOKENS = 128
REAL_STEP_S = 2.0
REAL_RATE = 150.0
#: real seconds the engines' timeline from a weight version to a sample may take (the floor
#: under the automatic time scale)
REAL_ENGINE_S = 10.0
#: the shortest real trainer step an automatic time scale may give: below it the control
#: plane's own hand-off a step is what the trainer would wait for
MIN_REAL_STEP_S = 0.05
MIN_STEPS = 8
#: the longest simulated run (``--minutes``, ``--search-minutes``): a simulated day
MAX_MINUTES = 1440.0
#: the most steps of one simulated run (a tiny step time with many minutes)
MAX_STEPS = 50_000
#: the file that marks a directory of ``--workdir`` as a simulated run of a plan (``simN``): a
#: later plan removes only such directories, never anything else the user put there
SIM_MARKER = ".astraflow-plan-sim"
#: what to do when ``--save-calibration`` or ``--workdir`` cannot be written
SAVE_FIX = "create its directory or give a --save-calibration path you can write"
WORKDIR_FIX = "give a --workdir directory you can write"


def _cannot_write(option: str, path: Path, err: OSError, fix: str) -> PlanError:
    return PlanError(f"{option} {path}: cannot write there ({err.strerror or err}); {fix}")


def check_save_path(path: Path) -> None:
    """PlanError naming the fix unless a file can be written at ``path`` (its directory exists and
    takes a new file): checked before a calibration takes its time, so that none is lost."""
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        with tempfile.TemporaryFile(dir=path.parent):
            pass
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as err:
        raise _cannot_write("--save-calibration", path, err, SAVE_FIX) from None


def check_workdir(workdir: Path) -> None:
    """Make ``workdir`` (and its parents) when missing; PlanError naming the fix unless it is then
    a directory that takes new files (checked before any run or calibration takes its time)."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass
    except OSError as err:
        raise _cannot_write("--workdir", workdir, err, WORKDIR_FIX) from None


@dataclass
class Calibration:
    """This machine's engine and trainer as measured on the config's model (``calibrate``)."""

    engine: HardwareProfile
    step_seconds: float
    prompt_tokens: int
    response_mean: float

    def save(self, path: Path) -> None:
        """Write the calibration to ``path``; PlanError naming the file and the fix when it cannot."""
        try:
            path.write_text(json.dumps({"engine": self.engine.model_dump(), "step_seconds": self.step_seconds,
                                        "prompt_tokens": self.prompt_tokens, "response_mean": self.response_mean},
                                       indent=2))
        except OSError as err:
            raise _cannot_write("--save-calibration", path, err, SAVE_FIX) from None

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        """The calibration saved at ``path``; PlanError naming the file (and the field whose value
        is out of range: every number of it is finite and above 0, the engine's peak rate at least
        its single-request rate) for anything else."""
        try:
            data = json.loads(path.read_text())
            engine = HardwareProfile(**data["engine"])
            numbers = {k: data[k] for k in ("step_seconds", "prompt_tokens", "response_mean")}
        except ValidationError as err:  # one line naming the field, not pydantic's whole report
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise PlanError(f"--calibration {path}: engine.{where} is {first.get('input')!r}: {first['msg']}; "
                            "measure again with --calibrate --save-calibration FILE") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise PlanError(f"--calibration {path}: not a calibration file ({err}); write one with "
                            "--calibrate --save-calibration FILE") from None
        for key, value in numbers.items():
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            if not ok or (key == "prompt_tokens" and value != int(value)):
                what = "a whole number >= 1" if key == "prompt_tokens" else "a finite number > 0"
                raise PlanError(f"--calibration {path}: {key} is {value!r}, not {what}; measure again with "
                                "--calibrate --save-calibration FILE")
        if engine.peak_tokens_per_s < engine.single_tokens_per_s:  # as a sim engine's section refuses it
            raise PlanError(f"--calibration {path}: engine.peak_tokens_per_s {engine.peak_tokens_per_s:g} is below "
                            f"engine.single_tokens_per_s {engine.single_tokens_per_s:g} (a batch cannot decode "
                            "slower than one request alone); measure again with --calibrate --save-calibration FILE")
        return cls(engine, float(numbers["step_seconds"]), int(numbers["prompt_tokens"]),
                   float(numbers["response_mean"]))


@dataclass
class PlanOptions:
    minutes: float = 10.0
    step_seconds: float | None = None
    prompt_tokens: int | None = None
    response_tokens: float | None = None
    time_scale: float | None = None
    model_params: float | None = None
    trainer: tuple[str, int] = ("h100", 8)
    wait_target: float = 0.10
    search: bool = True
    search_minutes: float | None = None
    max_trials: int = 6
    calibration: Calibration | None = None
    workdir: Path | None = None


@dataclass
class PlanReport:
    shape: SimShape
    shape_sources: dict[str, str]
    result: SimResult
    search: SearchResult | None
    trials: list[SimResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        s = self.search
        return {
            "assumptions": {"step_seconds": self.shape.step_seconds, "prompt_tokens": self.shape.prompt_tokens,
                            "response_tokens_mean": self.shape.response_mean, "time_scale": self.shape.time_scale,
                            "steps": self.shape.steps, "sources": self.shape_sources},
            "pools": self.result.pools,
            "overall": {k: v for k, v in self.result.to_json().items() if k not in ("pools", "per_pool")},
            "per_pool": self.result.per_pool,
            "no_wait": None if s is None else {
                "target_wait": s.target, "factor": s.factor, "limited": s.limited,
                "pools": dict(s.sizes) if s.sizes is not None else None,
                "trials": [{"factor": t.factor, "pools": dict(t.sizes), "trainer_wait": t.wait} for t in s.trials]},
        }


def shape_for(cfg: RunConfig, opts: PlanOptions, pools: tuple[Pool, ...] | list[Pool] = ()
              ) -> tuple[SimShape, dict[str, str]]:
    """The simulated run's step time, lengths, time scale and steps, with where each came from
    (the automatic time scale also from the engines' timeline on ``pools``)."""
    src: dict[str, str] = {}
    resp, sigma, src["response_tokens"] = _response_tokens(cfg, opts)
    prompt, src["prompt_tokens"] = _prompt_tokens(cfg, opts)
    step, src["step_seconds"] = _step_seconds(cfg, opts, prompt, resp)
    local = opts.calibration.engine if opts.calibration is not None else None
    if opts.time_scale is not None:
        scale, src["time_scale"] = opts.time_scale, "--time-scale"
    else:
        engine = engine_seconds(list(pools), SimShape(step, int(prompt), float(resp), sigma, 1.0, MIN_STEPS, local))
        scale = max(min(step / REAL_STEP_S, REAL_RATE * step / cfg.dataflow.batch_size), engine / REAL_ENGINE_S)
        src["time_scale"] = "auto"
        if step / scale < MIN_REAL_STEP_S:
            raise PlanError(f"a trainer step of {step:.3g} s ({src['step_seconds']}) is far shorter than the engines' "
                            f"{engine:.3g} s from a weight version to a sample (load, response): at the time scale "
                            f"that keeps those within {REAL_ENGINE_S:g} real s ({scale:.3g}) its real step is under "
                            f"{MIN_REAL_STEP_S:g} s, the control plane's own latency; give the trainer's real "
                            "--step-seconds S (its fixed costs a step included), or --time-scale S")
    steps = steps_for(opts.minutes, step, "--minutes")
    return SimShape(step, int(prompt), float(resp), sigma, scale, steps, local), src


def _response_tokens(cfg: RunConfig, opts: PlanOptions) -> tuple[float, float, str]:
    """The mean response length, the spread of its log-normal and where the mean came from."""
    cal, sim = opts.calibration, cfg.rollout.engine.type == "sim"
    sigma = cfg.rollout.engine.sim.length_sigma if sim else 0.8
    if opts.response_tokens is not None:
        return opts.response_tokens, sigma, "--response-tokens"
    if cal is not None:  # the measured mean already includes the cap: no spread around it
        return cal.response_mean, 0.0, "calibration"
    if sim:
        return cfg.rollout.engine.sim.length_mean, sigma, "rollout.engine.sim.length_mean"
    return max(cfg.workload.sampling.max_new_tokens / 2, 1.0), sigma, "half of max_new_tokens"


def _prompt_tokens(cfg: RunConfig, opts: PlanOptions) -> tuple[int, str]:
    if opts.prompt_tokens is not None:
        return opts.prompt_tokens, "--prompt-tokens"
    if opts.calibration is not None:
        return opts.calibration.prompt_tokens, "calibration"
    if cfg.workload.name == "sim":
        return int(cfg.workload.params.get("prompt_tokens", 64)), "workload.params"
    return DEFAULT_PROMPT_TOKENS, "default"


def _step_seconds(cfg: RunConfig, opts: PlanOptions, prompt: int, resp: float) -> tuple[float, str]:
    """The trainer's step in simulated seconds and where it came from: the option, the config's
    sim trainer, a calibration, or derived from the model's size and the batch's tokens."""
    if opts.step_seconds is not None:
        return opts.step_seconds, "--step-seconds"
    pol = cfg.policies[0]
    if all(p.trainer.backend == "sim" for p in cfg.policies):
        # a sim trainer sleeps real seconds; its engines run time_scale faster than real time. Its
        # per-token time is folded in at the mean batch (loss tokens: the responses'); a schedule
        # is left out, since the simulated trainer takes this one step time throughout
        tr = pol.trainer
        scale_in = cfg.rollout.engine.sim.time_scale if cfg.rollout.engine.type == "sim" else 1.0
        loss_tokens = cfg.dataflow.batch_size * resp
        step = (tr.sim_step_seconds + tr.sim_seconds_per_token * loss_tokens) * scale_in
        where = "trainer.sim_step_seconds x time_scale"
        if tr.sim_seconds_per_token:
            where = (f"(trainer.sim_step_seconds + sim_seconds_per_token x {loss_tokens:.0f} loss "
                     "tokens) x time_scale")
        if tr.sim_step_schedule:
            where += " (sim_step_schedule left out)"
        if not step > 0:
            raise PlanError("the config's sim trainer takes no time a step (sim_step_seconds and "
                            "sim_seconds_per_token are 0): give --step-seconds S")
        return step, where
    if opts.calibration is not None:
        return opts.calibration.step_seconds, "calibration"
    params = opts.model_params or model_params(Path(str(pol.model)))
    tokens = cfg.dataflow.batch_size * (prompt + resp)
    kind, n = opts.trainer
    return (derived_step_seconds(params, tokens, n, kind),
            f"derived: 6 x {params:.3g} params x {tokens:.0f} tokens on {kind}x{n}")


def steps_for(minutes: float, step_seconds: float, option: str) -> int:
    """Steps of a run of ``minutes`` simulated minutes (``MIN_STEPS`` at least); PlanError naming
    ``option`` and the bound for a run past ``MAX_MINUTES`` or ``MAX_STEPS``."""
    if not (0 < minutes <= MAX_MINUTES):
        raise PlanError(f"{option} {minutes:g}: give more than 0 and at most {MAX_MINUTES:g} simulated minutes "
                        "(the steady rates come within minutes; a longer run only takes longer)")
    steps = minutes * 60 / step_seconds
    if steps > MAX_STEPS:
        raise PlanError(f"{option} {minutes:g} at a trainer step of {step_seconds:.3g} s is {steps:.3g} simulated "
                        f"steps; a run takes at most {MAX_STEPS}: give fewer {option}")
    return max(math.ceil(steps), MIN_STEPS)


def model_params(path: Path) -> float:
    """Parameters of the HF model in ``path`` from its ``config.json`` (attention, MLP and
    embeddings); PlanError naming ``--model-params`` / ``--step-seconds`` when there is none."""
    try:
        c = json.loads((path / "config.json").read_text())
        h, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    except (OSError, ValueError, KeyError) as err:
        raise PlanError(f"the trainer's step time cannot be derived: no model config at {path} ({err}); give "
                        "--step-seconds S (or --model-params N), or --calibrate on this machine") from None
    heads, kv = c.get("num_attention_heads", 1), c.get("num_key_value_heads", c.get("num_attention_heads", 1))
    attn = 2 * h * h + 2 * h * (h * kv // heads)
    embeds = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2)
    return float(layers * (attn + 3 * h * inter) + embeds)


def run_plan(cfg: RunConfig, pools: list[Pool], opts: PlanOptions,
             progress: Callable[[str], None] = lambda s: None) -> PlanReport:
    """Simulate ``cfg`` on ``pools`` for ``opts.minutes`` simulated minutes, then (``opts.search``)
    search the pool sizes at which the trainer stops waiting with shorter runs. The simulated
    runs go to ``opts.workdir`` (kept until the next plan there, which starts afresh), else to a
    temporary directory removed at the end."""
    if len(cfg.policies) > 1:  # the sim workload and workflow drive one policy
        names = ", ".join(p.name for p in cfg.policies)
        raise PlanError(f"the config has {len(cfg.policies)} policies ({names}); astraflow plan simulates one: "
                        "plan a copy of the config that keeps one policy (and a single-policy workflow)")
    if cfg.run.mode == "sync":  # its trainer waits between steps, not inside them: the wait is not measured
        raise PlanError("run.mode is sync: the trainer idles while each rollout phase runs, which its wait "
                        "fraction (what the plan sizes pools by) does not count; plan the config with "
                        "--set run.mode=async")
    shape, sources = shape_for(cfg, opts, pools)
    if cfg.workload.workflow not in ("single_turn", "sim"):  # the sim workflow is one request an episode
        progress(f"warning: workflow {cfg.workload.workflow} runs episodes of several engine requests (turns, "
                 "tools); the plan simulates one request per episode of the config's response length, so its "
                 "rates are single-turn episodes' and its trainer wait a lower bound")
    ignored = ignored_sim_settings(cfg)
    if ignored:  # each pool's engines follow its kind (or the calibration), not the config's engine
        progress(f"warning: {', '.join(ignored)} not simulated: a named pool's engines follow its hardware "
                 "preset; to plan another GPU or model, calibrate it as a local pool (--pool local=N --calibrate "
                 "on that machine, or --calibration FILE)")
    if opts.search:  # the search's runs too, before the first run takes its time
        steps_for(_search_minutes(opts), shape.step_seconds, "--search-minutes" if opts.search_minutes else "--minutes")
    kinds = [p.kind for p in pools]
    if len(set(kinds)) != len(kinds):
        raise PlanError(f"--pool: each hardware kind once (got {', '.join(kinds)}); add the GPUs up into one pool")
    try:
        config_from_dict(sim_config(cfg, pools, shape))
    except ConfigError as err:
        raise PlanError(f"the config cannot be simulated: {err}") from None
    if opts.workdir is not None:
        check_workdir(opts.workdir)
        clear_workdir(opts.workdir, 1 + (opts.max_trials if opts.search else 0))
        return _run_plan(cfg, pools, opts, shape, sources, opts.workdir, progress)
    with tempfile.TemporaryDirectory(prefix="astraflow-plan-") as tmp:  # nothing is kept
        try:
            return _run_plan(cfg, pools, opts, shape, sources, Path(tmp), progress)
        except SimFailed as err:
            kept = "(the simulated runs' files are removed: pass --workdir DIR to keep them)"
            raise SimFailed(f"{err}\n{kept}") from None


def clear_workdir(workdir: Path, runs: int) -> None:
    """Make ``workdir`` ready for a plan of ``runs`` simulated runs (``sim0``, ``sim1``, ...):
    every plan simulates afresh, so the simulated runs an earlier plan left there (the
    directories marked with ``SIM_MARKER``) are removed; a run started on one of them would resume
    it and mix its steps into the numbers. PlanError naming the fix, before anything is removed,
    when a directory the plan would use is not one of its own or an earlier plan's run still runs."""
    if not workdir.is_dir():
        return
    own = [d for d in workdir.iterdir()
           if re.fullmatch(r"sim\d+", d.name) and not d.is_symlink() and (d / SIM_MARKER).is_file()]
    for d in (workdir / f"sim{i}" for i in range(runs)):
        if (d.exists() or d.is_symlink()) and d not in own:
            raise PlanError(f"--workdir {workdir}: {d} was not made by astraflow plan (no {SIM_MARKER} in it) and a "
                            "simulated run would go there: move it away or give another --workdir")
    for d in own:
        pid = _running(d / "run.pid")
        if pid is not None:
            raise PlanError(f"--workdir {workdir}: the simulated run in {d} is still running (pid {pid}): stop it "
                            "(or wait for it) or give another --workdir")
    for d in own:
        shutil.rmtree(d)


def _running(pid_file: Path) -> int | None:
    """The PID in ``pid_file`` when that process is running and is an ``astraflow run`` (a PID
    reused by another process does not count), else None."""
    import psutil

    try:
        pid = int(pid_file.read_text())
        proc = psutil.Process(pid)
        cmd, cwd = proc.cmdline(), proc.cwd()
    except (OSError, ValueError, psutil.Error):
        return None
    config = (pid_file.parent / "config.yaml").resolve()
    return pid if "astraflow" in cmd and any((Path(cwd) / a).resolve() == config for a in cmd) else None


def _search_minutes(opts: PlanOptions) -> float:
    return opts.search_minutes or max(opts.minutes / 2, min(opts.minutes, 1.0))


def _run_plan(cfg: RunConfig, pools: list[Pool], opts: PlanOptions, shape: SimShape, sources: dict[str, str],
              workdir: Path, progress: Callable[[str], None]) -> PlanReport:
    trials: list[SimResult] = []

    def simulate(sized: list[Pool], sim_shape: SimShape, tag: str) -> SimResult:
        label = " ".join(p.label() for p in sized)
        simulated_min = sim_shape.steps * sim_shape.step_seconds / 60
        progress(f"{tag}: simulating {label} for {sim_shape.steps} steps ({simulated_min:.1f} simulated min, time "
                 f"scale {sim_shape.time_scale:.2g}: at least {simulated_min / sim_shape.time_scale:.1f} min of real "
                 "time, more while the trainer waits; --minutes or --time-scale to change it)")
        sim_dir = workdir / f"sim{len(trials)}"
        try:
            sim_dir.mkdir(parents=True)  # fresh: ``clear_workdir`` removed an earlier plan's
            (sim_dir / SIM_MARKER).write_text("a simulated run of astraflow plan: the next plan on this --workdir "
                                              "removes this directory\n")
        except OSError as err:  # the directory changed (or filled up) since ``check_workdir``
            raise _cannot_write("--workdir", sim_dir, err, WORKDIR_FIX) from None
        res = run_sim(sim_config(cfg, sized, sim_shape), sim_dir, {p.kind: p.gpus for p in sized},
                      sim_shape.time_scale, progress=lambda s: progress(f"{tag}: {s}"))
        progress(f"{tag}: {res.steps_per_s:.3g} steps/s, trainer wait {res.trainer_wait:.0%}, "
                 f"{res.trajectories_per_s:.4g} trajectories/s ({res.real_seconds:.0f}s real)")
        trials.append(res)
        return res

    result = simulate(pools, shape, "plan")
    search = None
    if opts.search:
        short = SimShape(shape.step_seconds, shape.prompt_tokens, shape.response_mean, shape.response_sigma,
                         shape.time_scale, steps_for(_search_minutes(opts), shape.step_seconds, "--search-minutes"),
                         shape.local)

        def sizes(factor: float) -> tuple[tuple[str, int], ...]:
            return tuple((p.kind, p.scaled(factor).gpus) for p in pools)

        def actual(factor: float) -> float:  # the factor of the sizes simulated (whole nodes)
            return simulated_factor(pools, factor)

        search = find_scale(lambda f: simulate([p.scaled(f) for p in pools], short,
                                               f"search x{actual(f):.3g}").trainer_wait,
                            sizes, opts.wait_target, base_wait=result.trainer_wait, max_trials=opts.max_trials,
                            max_factor=min(64.0, *(MAX_NODES / p.nodes for p in pools)),  # no pool past MAX_NODES
                            simulated=actual)
    return PlanReport(shape, sources, result, search, trials)
