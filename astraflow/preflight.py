"""Checks of a validated config against this machine, apart from validation (which stays
cheap and needs nothing on disk): the policies' model directories load (or can be created where
they are missing), the GPUs asked for by components that run here exist, the chosen engine and
trainer backend are installed, the run's addresses bind here, evaluations find held-out prompts.
Each raises ``ConfigError`` (or ``ValueError``) naming the field and the fix; ``astraflow check``
and ``astraflow run`` call them. What a model's positions leave a generation and a prompt is
measured in ``context_fit``."""

from __future__ import annotations

import json
from typing import Any

from astraflow.config import ConfigError, RunConfig
from astraflow.context_fit import check_engine_positions, max_positions, vllm_positions
from astraflow.partition_settings import effective_rollout, effective_trainer
from storage.ownership import unbuildable


def check_models(cfg: RunConfig) -> None:
    """Check that every policy model directory that exists loads (config, architecture, readable and
    complete weight files, a tokenizer that encodes; only the weight files' headers are read), and
    that the Megatron backend can build its architecture where a policy trains with it:
    ``ConfigError`` naming the policy, the directory and the fix. A directory still to be built by
    ``init`` is only checked to be creatable (both archs of ``init`` convert), its preset's positions
    to hold a generation, its preset's shape to be sharded by a Megatron ``tensor_parallel`` and,
    warm-started from another policy's model, that model's tokenizer to have an eos token, so
    that a run fails here, before its run directory is made, not half-way through. Separate from
    validation, which stays cheap and needs no model on disk."""
    import json

    from astraflow.models import check_model_dir

    for pol in cfg.policies:
        if cfg.simulated(pol):  # its model is only a name, whatever lies at that path
            continue
        if not pol.model.exists():
            why = unbuildable(pol.model)
            if why:
                raise ConfigError(f"policies[{pol.name}].model: {pol.model} cannot be created to build the model "
                                  f"into: {why}; point model at a directory that can be created (or at an "
                                  "existing HF model directory)")
            _check_warm_start_base(cfg, pol)
            planned = _planned_config(pol)
            if planned is not None:
                _check_positions(cfg, pol, planned, "to be built by init")
                _check_megatron_shape(pol, planned, "to be built by init")
            continue
        check_built_from_init(pol)
        try:
            check_model_dir(pol.model)
        except ValueError as err:
            if pol.init is not None and pol.model.is_dir() and not any(pol.model.iterdir()):
                raise ConfigError(f"policies[{pol.name}].model: {pol.model} exists and is empty, so init does not "
                                  "build the model into it: remove the empty directory") from None
            raise ConfigError(f"policies[{pol.name}].model: {err}") from None
        config = json.loads((pol.model / "config.json").read_text())
        _check_positions(cfg, pol, config)
        _check_megatron_shape(pol, config)


def check_built_from_init(pol) -> None:
    """An existing model directory that records the ``init`` it was built from (``INIT_RECORD``)
    must be the model the policy's ``init`` asks for: else the run would train the old model
    and ignore the new ``init`` without a word. A directory without a record (a user's
    checkpoint, one built by an older AstraFlow) or a policy without ``init`` is left alone."""
    from pydantic import ValidationError

    from astraflow.models import WARM_STARTED_ON, recorded_init
    from astraflow.training.config import ModelInit

    recorded = recorded_init(pol.model) if pol.init is not None else None
    if recorded is None:
        return
    recorded.pop(WARM_STARTED_ON, None)  # what it trained on, not how it was built
    try:
        old = ModelInit.model_validate(recorded).build_settings()
    except ValidationError:  # a record of another AstraFlow's settings: nothing to compare with
        return
    new = pol.init.build_settings()
    unused = object()  # a setting one of the two builds does not use
    keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k, unused) != new.get(k, unused)]
    if not keys:
        return

    def said(settings: dict) -> str:
        return ", ".join(f"{k}: {json.dumps(settings[k])}" for k in keys if k in settings)

    raise ConfigError(f"policies[{pol.name}].model {pol.model} was built with init {{{said(old)}}}, the config's "
                      f"init asks for {{{said(new)}}}: remove {pol.model} to rebuild it, or drop init (or restore "
                      "it as it was) to train the model that is there")


def _check_megatron_shape(pol, config: dict, built: str = "") -> None:
    """A policy trained by the Megatron backend: its model (HF ``config``) must be one Megatron
    builds, and ``tensor_parallel`` must shard it (heads, KV heads, vocabulary, MLP width), else
    the ranks fail when they start. ``built``: how the model comes to be, where it does not exist
    yet (said in the message)."""
    if pol.trainer.backend != "megatron":
        return
    from astraflow.weightconv import GPTShape

    where = f"{pol.model} ({built})" if built else str(pol.model)
    try:
        shape = GPTShape.from_hf_config(config)
    except ValueError as err:
        raise ConfigError(f"policies[{pol.name}].model: {where}: trainer.backend megatron "
                          f"cannot train it: {err}") from None
    problem = shape.tensor_parallel_problem(pol.trainer.tensor_parallel)
    if problem:
        raise ConfigError(f"policies[{pol.name}].trainer.tensor_parallel: {where}: {problem}")


def _planned_config(pol) -> dict | None:
    """The HF config (as a dict) of the model ``init`` will build for ``pol`` from its preset;
    None for one started from an earlier policy's model, whose own check covers it."""
    if pol.init is None or pol.init.start_from:
        return None
    from astraflow.models import make_config

    return make_config(pol.init.preset, pol.init.arch, tie_word_embeddings=pol.init.tie_embeddings).to_dict()


def _check_positions(cfg: RunConfig, pol, config: dict, built: str = "") -> None:
    """A generation of ``workload.sampling.max_new_tokens`` (an agentic episode: its whole
    ``max_context_tokens``) must fit the model's ``max_position_embeddings``: past it every
    request fails, or decodes garbage. ``built``: how the model comes to be, where it does not
    exist yet (said in the message)."""
    positions = max_positions(config)
    if not isinstance(positions, int) or cfg.simulated(pol):
        return
    from astraflow.workloads.base import params_model

    new = cfg.workload.sampling.max_new_tokens
    model = params_model(cfg.workload.name)
    try:  # an agentic workload's episode budget (validated already)
        episode = getattr(model(**cfg.workload.params), "max_context_tokens", None) if model else None
    except (ValueError, TypeError):
        episode = None
    where = f"{pol.model}, {built}" if built else str(pol.model)
    if new >= positions:
        raise ConfigError(f"workload.sampling.max_new_tokens {new}: the model of policy {pol.name} ({where}) "
                          f"has {positions} positions for the prompt and the generation together; lower "
                          f"max_new_tokens below {positions} (less the longest prompt)")
    if isinstance(episode, int) and episode > positions:
        raise ConfigError(f"workload.params.max_context_tokens {episode}: the model of policy {pol.name} "
                          f"({where}) has {positions} positions; lower max_context_tokens to {positions}")
    check_engine_positions(cfg, vllm_positions(config) or positions, positions, f"policy {pol.name} ({where})")


def _check_warm_start_base(cfg: RunConfig, pol) -> None:
    """A policy to be warm-started from an existing model (``init.start_from``) needs that model's
    tokenizer to have an eos token (``require_eos``): refused here, before the run builds anything,
    rather than once its warm start has begun."""
    init = pol.init
    if init is None or not init.start_from or not init.warm_starts or cfg.simulated(pol):
        return
    base = cfg.policy(init.start_from).model
    if not base.is_dir():  # built by its own init: a tokenizer of ours, which has one
        return
    from astraflow.models import load_tokenizer
    from astraflow.training.warmstart import require_eos

    try:
        require_eos(load_tokenizer(base), base)
    except ValueError as err:
        raise ConfigError(f"policies[{pol.name}].init.start_from: {init.start_from}: {err}") from None


def check_devices(cfg: RunConfig) -> None:
    """``ConfigError`` when a GPU (``cuda``, ``cuda:N``) is asked for by a component of a
    ``scheduler: local`` partition (it runs on this machine; its device is the run's setting
    with the partition's own ``rollout:`` / ``trainer:`` over it) and torch sees no such GPU
    here. Components on Slurm partitions run elsewhere and are not judged from here."""
    asked = []
    for part in cfg.partitions:
        if part.scheduler != "local":
            continue
        if part.role == "rollout":
            own = "device" in part.rollout.get("engine", {})
            field = f"partitions[{part.name}].rollout.engine.device" if own else "rollout.engine.device"
            asked.append((field, effective_rollout(cfg.rollout, part).engine.device, "rollout"))
        elif part.role == "trainer":
            for pol in cfg.policies:
                if pol.trainer.backend != "torch":
                    continue
                own = "device" in part.trainer
                field = f"partitions[{part.name}].trainer.device" if own else f"policies[{pol.name}].trainer.device"
                asked.append((field, effective_trainer(pol.trainer, part).device, "trainer"))
    asked = [(field, dev, role) for field, dev, role in dict.fromkeys(asked) if dev.startswith("cuda")]
    if not asked:
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for field, dev, role in asked:
        index = int(dev.partition(":")[2] or 0)
        if index >= have:
            seen = f"torch sees {have} GPU(s) here" if have else "torch sees no GPU here"
            raise ConfigError(f"{field}: {dev!r} asked for, but {seen} and the {role} runs on this machine "
                              f"(a scheduler: local partition); set {field}: auto or cpu, or place "
                              f"the {role} on a GPU partition (scheduler: slurm)")


def check_engine(cfg: RunConfig) -> None:
    """``ConfigError`` with the install command when a rollout partition's engine is ``vllm``
    (``rollout.engine.type``, or a partition's own ``rollout.engine.type``) and vLLM is not
    installed in this environment (the one the run's workers use), or a policy trains with the
    Megatron backend and megatron-core is not installed."""
    for pol in cfg.policies:
        if pol.trainer.backend != "megatron":
            continue
        from astraflow.model_loading import is_installed

        if not is_installed("megatron.core"):
            raise ConfigError(f"policies[{pol.name}].trainer.backend: megatron needs megatron-core, which is not "
                              "installed here; install it with pip install -e '.[megatron]' (from the AstraFlow "
                              "checkout), or set trainer.backend: torch")
    for part in cfg.partitions:
        if part.role != "rollout" or effective_rollout(cfg.rollout, part).engine.type != "vllm":
            continue
        from astraflow.rollout.vllm_setup import require_vllm

        own = "type" in part.rollout.get("engine", {})
        try:
            require_vllm(f"partitions[{part.name}].rollout.engine.type" if own else "rollout.engine.type")
        except ValueError as err:
            raise ConfigError(str(err)) from None


def models_that_never_stop(cfg: RunConfig) -> list[str]:
    """A line per policy whose model (one that exists) has no token a generation ends on: no eos
    in its tokenizer, generation_config.json or config.json, no chat-template closing token and
    no ``<|im_end|>`` or ``<|endoftext|>``. Every turn then runs to ``max_new_tokens``, which a
    run allows (a workload may want fixed-length answers) but rarely means."""
    from astraflow.agents.chat import turn_stop_ids
    from astraflow.model_loading import load_tokenizer

    lines = []
    for pol in cfg.policies:
        if cfg.simulated(pol) or not (pol.model / "config.json").is_file():
            continue  # a model init builds has its end tokens
        gen = pol.model / "generation_config.json"
        try:
            eos = json.loads((gen if gen.is_file() else pol.model / "config.json").read_text()).get("eos_token_id")
        except (ValueError, UnicodeDecodeError, AttributeError):  # check_models said what is wrong with it
            continue
        if turn_stop_ids(load_tokenizer(pol.model)) or eos not in (None, []):
            continue
        lines.append(f"policy {pol.name}: {pol.model} has no end-of-sequence token (no eos_token in its tokenizer, "
                     "no eos_token_id in generation_config.json or config.json, no chat template closing one), so "
                     f"every generation runs to workload.sampling.max_new_tokens "
                     f"({cfg.workload.sampling.max_new_tokens}); set the tokenizer's eos_token (tokenizer_config.json) "
                     "if the model has one")
    return lines


def eval_split_lines(workload, held_out: list) -> list[str]:
    """What the evaluations ``workload.eval`` asks for will find in the held-out split
    ``held_out``: a ``ValueError`` when it is empty (no evaluation would ever run), a line when
    ``num_prompts`` is more than it holds (the data layer takes the prompts there are; those of
    a second evaluation set, tagged ``eval_set``, come whole and are not counted)."""
    ev = workload.eval
    if ev.every == 0:
        return []
    if not held_out:
        from astraflow.workloads.base import params_model

        model = params_model(workload.name)
        knob = " (workload.params.num_test)" if model is not None and "num_test" in model.model_fields else ""
        raise ValueError(f"workload.eval.every {ev.every}: workload {workload.name} has no held-out prompts, so no "
                         "evaluation would ever run; set workload.eval.every: 0 to train without evaluations, or "
                         f"give the workload a held-out split{knob}")
    plain = sum(1 for p in held_out if not (isinstance(p, dict) and "eval_set" in p))
    if 0 < plain < ev.num_prompts:
        return [f"workload.eval.num_prompts {ev.num_prompts}: the held-out split has {plain} prompts, so each "
                f"evaluation takes those {plain}"]
    return []


def held_out_overlap(train: list, held_out: list) -> list[str]:
    """A line when held-out prompts are also training prompts (the same prompt text, or messages):
    their evaluations would count problems the policy trains on, as a test file that repeats the
    train file does."""
    def key(p: Any) -> str | None:
        text = p.get("messages") or p.get("prompt") or p.get("question") if isinstance(p, dict) else None
        if not text or isinstance(text, str):
            return text or None
        return json.dumps(text, sort_keys=True, default=str)

    seen = {k for k in map(key, train) if k is not None}
    both = [p for p in held_out if (k := key(p)) is not None and k in seen]
    if not both:
        return []
    where = both[0].get("row") or both[0].get("id")
    return [f"warning: {len(both)} of the {len(held_out)} held-out prompts are also training prompts"
            + (f" (the first: {where})" if where else "") + ": their evaluations count problems the policy trains "
            "on; hold out prompts the train split does not have (a test file without them)"]


def check_network(cfg: RunConfig) -> None:
    """``ConfigError`` naming the cluster setting when an address the run binds on this machine
    cannot be: ``scheduler_interface`` with no IPv4 address here, a ``scheduler_host`` or
    ``dashboard_host`` that does not resolve, a ``worker_interface`` missing here while a
    partition's workers run here (``scheduler: local``). Checked when the run starts, on the
    machine that runs it (``astraflow check`` on a login node may see other interfaces)."""
    import socket

    import psutil

    from schedulers.command import interface_address

    cc = cfg.cluster
    if cc.scheduler_interface:
        try:
            interface_address(cc.scheduler_interface, "cluster.scheduler_interface")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    for key in ("scheduler_host", "dashboard_host"):
        host = getattr(cc, key)
        if host and not (key == "scheduler_host" and cc.scheduler_interface):
            try:
                socket.getaddrinfo(host, None)
            except OSError as err:
                raise ConfigError(f"cluster.{key}: {host!r} does not resolve on this machine ({err}); give an "
                                  "address of this machine (127.0.0.1 keeps the run on it)") from None
    local = [p.name for p in cfg.partitions if p.scheduler == "local"]
    if cc.worker_interface and local and cc.worker_interface not in psutil.net_if_addrs():
        raise ConfigError(f"cluster.worker_interface: {cc.worker_interface!r} is no network interface of this "
                          f"machine, where partitions {', '.join(local)} start their workers (there are: "
                          f"{', '.join(sorted(psutil.net_if_addrs()))}); name one of them, or unset it")


def check_slurm_partitions(cfg: RunConfig) -> None:
    """``ConfigError`` naming a ``scheduler: slurm`` partition whose ``slurm_partition`` this
    site's Slurm does not have (``sinfo --all`` lists them), before anything starts: otherwise
    the run starts its scheduler, data layer and trainer, then fails on ``sbatch``'s refusal.
    Nothing is checked where ``sinfo`` does not answer (no Slurm here: submitting will say)."""
    wanted = {p.name: p.slurm_partition for p in cfg.partitions if p.scheduler == "slurm" and p.slurm_partition}
    if not wanted:
        return
    from schedulers.slurm_cli import SlurmCommandError, run_slurm

    try:
        out = run_slurm(["sinfo", "--all", "-h", "-o", "%R"], timeout=10)
    except SlurmCommandError:
        return
    known = sorted({line.strip() for line in out.splitlines() if line.strip()})
    for name, slurm_partition in wanted.items():
        missing = [s for s in slurm_partition.split(",") if s.strip() not in known]
        if known and missing:
            raise ConfigError(f"partitions[{name}].slurm_partition: {', '.join(map(repr, missing))} is not a "
                              f"partition of this Slurm cluster (sinfo lists {', '.join(known)}): set it to one "
                              "of them")
