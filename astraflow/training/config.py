"""Config of what the training side owns: each policy's model, how it is built, its trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from astraflow.configbase import Strict
from storage.paths import NAME_MAX, is_plain_name


class ModelInit(Strict):
    """How to build a model directory that does not exist yet (no downloads: built locally)."""

    preset: Literal["tiny", "mini", "small", "50m"] = "small"
    """Size preset of the locally initialised model (tiny ~0.8M, mini ~3.2M, small ~10M, 50m ~47M params)."""
    arch: Literal["qwen2", "llama"] = "qwen2"
    """HF architecture of the initialised model."""
    tie_embeddings: bool = True
    """Whether the output head shares the input embedding's weights (``tie_word_embeddings``);
    ``false`` gives the model a separate ``lm_head``, as most larger checkpoints have."""
    seed: int = Field(default=0, ge=0, lt=2**32)
    """Seed of the random initialisation and the warm start (0 to 2**32 - 1, the seeds torch takes)."""
    tokenizer: Literal["byte", "bpe"] = "byte"
    """``byte``: a byte-level tokenizer with no merges (every byte one token; the fast examples).
    ``bpe``: a byte-level BPE trained on the workload's train split (its prompts and reference
    solutions; an agentic workload's expert episodes), as real checkpoints have: shorter
    sequences, multi-byte tokens. Both have a chat template."""
    vocab_size: int = Field(default=1024, ge=262, le=65536)
    """``tokenizer: bpe``: vocabulary size (bytes, merges and special tokens)."""
    warm_start_seconds: float = Field(default=0.0, ge=0)
    """Supervised warm start on the workload's train split, in seconds (0: none). A partly
    competent policy gives RL a non-zero reward signal."""
    warm_start_steps: int | None = Field(default=None, ge=1)
    """Upper bound of the warm start in optimiser steps (``None``: none; set alone, it runs
    the warm start with no time bound). The warm start is seeded, so a bound in steps builds
    the same model on a fast and a slow machine of one kind, which a bound in seconds does not
    (a CPU of another kind rounds differently, and the models part ways within steps). With
    several bounds the first reached stops it."""
    warm_start_lr: float = Field(default=1e-3, gt=0, allow_inf_nan=False)
    """Learning rate of the warm start."""
    warm_start_target: float | None = Field(default=None, gt=0, le=1)
    """Stop the warm start as soon as held-out accuracy reaches this (checked every 25 steps;
    ``warm_start_seconds`` / ``warm_start_steps`` stay the upper bounds). Makes RL start from
    the same competence on fast and slow machines. ``None``: run to the bounds. A warm start that
    ends at a bound short of it says so; the model kept is that of its best evaluation."""
    demo_noise: float = Field(default=0.0, ge=0, lt=1)
    """Agentic warm start: the share of the expert's turns replaced by a random plausible
    command (the environment's ``explore_action``), the expert recovering from where it led: an
    epsilon-greedy expert, as offline-RL datasets of "medium" quality are. The warm-started
    policy then knows the task but acts noisily when sampled, which RL learns to stop."""
    task: Literal["solve", "solve_retry", "verify", "select", "test"] = "solve"
    """Role the warm start teaches: ``solve`` (``"12+34="`` -> ``"46"``), ``solve_retry`` (the
    ``solver_verifier`` solver: half ``solve``, half its retry turn after a reject), ``verify`` (the
    ``solver_verifier`` verifier: ``"12+34=47?"`` -> ``"46N"``, its own sum, then the verdict) or
    ``select`` (the ``solver_selector`` selector: ``"12+34=46|47?"`` -> ``"46>1"``, its own sum,
    then the position of the candidate equal to it) or ``test`` (the ``solver_testgen`` tester of
    the ``code`` workload: the problem, ``# tests`` -> asserts taken from the hidden tests,
    ``astraflow.workloads.testgen``). Pick the one matching the policy's role in the workflow."""
    start_from: str | None = None
    """Name of an earlier policy in ``policies`` whose model this one starts from instead of a
    random initialisation (``preset``, ``arch``, ``tie_embeddings`` and ``seed`` are then
    unused): the roles of one workflow sharing one base model, as multi-agent RL starts every
    agent from the same pretrained checkpoint. The warm start then teaches this policy's
    ``task`` on top."""

    @property
    def warm_starts(self) -> bool:
        """Whether the build includes a supervised warm start."""
        return self.warm_start_seconds > 0 or self.warm_start_steps is not None

    def build_settings(self) -> dict:
        """The settings that shape the model this section builds, as JSON values: what a model
        directory built from it must match (``preflight``). With ``start_from`` the base model's
        shape and tokenizer are copied, and without a warm start its settings do nothing."""
        out = self.model_dump(mode="json")
        unused = (("preset", "arch", "tie_embeddings", "tokenizer", "vocab_size") if self.start_from else ()) + (
            () if self.warm_starts else ("warm_start_lr", "warm_start_target", "demo_noise", "task"))
        return {k: v for k, v in out.items() if k not in unused}

    @model_validator(mode="after")
    def _settings_that_act(self) -> "ModelInit":
        """A setting that would change nothing is refused, naming what makes it act."""
        if self.warm_start_target is not None and not self.warm_starts:
            raise ValueError("warm_start_target stops a warm start early, and there is none: give it an upper "
                             "bound, warm_start_steps (e.g. 2000) or warm_start_seconds")
        if self.vocab_size != type(self).model_fields["vocab_size"].default and self.tokenizer != "bpe":
            raise ValueError("vocab_size sizes a BPE tokenizer; with tokenizer: byte it is fixed: set tokenizer: bpe "
                             "or drop vocab_size")
        return self


class TrainerConfig(Strict):
    """The trainer of one policy (owned by ``astraflow.training``)."""

    backend: Literal["torch", "megatron", "sim"] = "torch"
    """``torch``: plain PyTorch in the trainer worker; ``megatron``: Megatron-core ranks; ``sim``:
    no model, each step takes ``sim_step_seconds`` (+ ``sim_seconds_per_token``) and publishes a
    tiny version (``docs/sim.md``)."""
    sim_step_seconds: float = Field(default=1.0, ge=0)
    """``backend: sim``: the time one optimiser step takes."""
    sim_seconds_per_token: float = Field(default=0.0, ge=0)
    """``backend: sim``: time added per loss token of the batch."""
    sim_step_schedule: dict[int, float] = Field(default_factory=dict)
    """``backend: sim``: step times that change mid-run, ``{from_step: seconds}``: from that
    step on (counted from 0) a step takes that long instead of ``sim_step_seconds``, e.g.
    ``{40: 2.0}`` slows the trainer down after 40 steps (a trainer whose speed changes, for
    studying the autoscaler)."""

    @field_validator("sim_step_schedule")
    @classmethod
    def _schedule(cls, v: dict[int, float]) -> dict[int, float]:
        bad = {k: s for k, s in v.items() if k < 0 or not (s >= 0 and s != float("inf"))}
        if bad:
            raise ValueError(f"sim_step_schedule {bad}: use {{from_step: seconds}} with steps >= 0 and finite "
                             "seconds >= 0, e.g. {40: 2.0}")
        return dict(sorted(v.items()))
    tensor_parallel: int = Field(default=1, ge=1)
    """Megatron tensor-parallel size (ranks started by the trainer actor); 1 for ``torch`` and ``sim``."""
    data_parallel: int = Field(default=1, ge=1)
    """Megatron data-parallel size: replicas of the tensor-parallel group, each training on its
    share of every batch (shares balanced by token count), gradients summed across replicas
    before the step, which is the one a single replica takes on the whole batch. The trainer
    starts ``tensor_parallel * data_parallel`` ranks (one GPU each on a GPU node, gloo
    processes on a CPU one); a batch needs at least ``data_parallel`` sequences. 1 for ``torch`` and
    ``sim``."""
    lr: float = Field(default=5e-4, gt=0, allow_inf_nan=False)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO clip range below 1 for the importance ratio (below 1: ``1 - clip_low`` stays positive)."""
    clip_high: float = Field(default=0.28, ge=0)
    """PPO clip range above 1 (a higher upper clip keeps exploration alive)."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping norm."""
    micro_batch: int = Field(default=64, ge=1)
    """Sequences per forward/backward (gradient accumulation over the batch); the torch backend's
    (the megatron backend trains each data-parallel share at once)."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads of the trainer process, and of the policy's warm start (``init``)."""
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the torch backend trains: ``auto`` (the worker's GPU when it has one, else the
    CPU), ``cpu``, ``cuda`` or ``cuda:N``. The megatron backend places its ranks itself."""
    batch_timeout_s: float = Field(default=600.0, gt=0)
    """How long the trainer waits for one batch before it fails the run."""
    max_nonfinite_steps: int = Field(default=3, ge=1)
    """Steps in a row with a loss or gradient norm that is not finite (nan/inf) after which the
    trainer stops the run, naming the likely cause (``lr`` too high, or bad data). The torch
    backend skips each such step (no weight changes; ``nonfinite_skipped`` in its metrics, and
    its version republishes the same weights); weights that are not finite are never published."""
    off_policy: Literal["ppo_clip", "tis", "m2po"] = "ppo_clip"
    """How the loss corrects for stale (off-policy) tokens, through the per-token ratio
    ``r = pi_new / pi_behaviour``: ``ppo_clip`` clips ``r`` to ``[1 - clip_low, 1 + clip_high]``
    (PPO surrogate); ``tis`` weights the policy gradient by ``min(r, is_cap)`` (truncated
    importance sampling); ``m2po`` masks the tokens with the largest ``(log r)^2`` until their
    batch mean is at most ``m2_tau`` (over the whole batch, whatever ``micro_batch``) and uses
    the unclipped ratio on the rest. The Megatron
    backend supports ``ppo_clip`` only."""
    advantage: str = "grpo"
    """How a batch's rewards become advantages: ``grpo`` (the reward normalised within its
    group), ``dr_grpo`` (minus the group mean, not divided by its std), ``rloo`` (minus the mean
    of the group's other samples), ``batch_norm`` (minus the group mean, then normalised over
    the batch: REINFORCE++), or ``package.module:function`` of your own, given the batch's items
    (reward, group mean/std/size) and returning one advantage each (``docs/extending.md``)."""
    loss_fn: str = "grpo"
    """The policy loss: ``grpo`` (the token-level clipped loss, with ``off_policy``'s correction),
    or ``package.module:function`` of your own with ``grpo_loss``'s arguments
    ``(new_logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, num_tokens)``,
    returning the loss or ``(loss, stats)``. Every sequence is then trained, whatever its
    advantage (a KL term has a gradient where the advantage is 0)."""
    kl_coef: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Weight of a KL penalty to the model the run started from (the policy's ``model``), as in
    the GRPO paper: per token, the k3 estimate ``exp(ref - new) - (ref - new) - 1``, normalised
    like the loss; logged as ``kl_ref``. 0 (the default): none. Torch backend only; it keeps a
    frozen copy of that model on the trainer's device, runs one more forward per micro-batch
    and trains every sequence, also those whose advantage is 0."""
    is_cap: float = Field(default=2.0, gt=0)
    """``off_policy: tis``: the truncation ``C`` of the importance weight ``min(r, C)``."""
    m2_tau: float = Field(default=0.04, gt=0)
    """``off_policy: m2po``: bound on the mean ``(log r)^2`` of the tokens kept in the loss."""
    optimizer_checkpoint_every: int = Field(default=100, ge=0)
    """Save the optimiser state (AdamW moments) every this many steps and when the trainer
    stops, under ``<run>/trainer_state/<policy>/`` (with the fp32 weights when ``publish_dtype``
    is narrower); a run resumed on the same run directory continues with it instead of fresh
    moments. The Megatron backend's state is per tensor-parallel rank: a resume with another
    ``tensor_parallel`` cuts it again for its ranks, and another ``data_parallel`` keeps it (the
    replicas' moments are equal). 0: only when the trainer stops."""
    skip_zero_advantage: bool = True
    """Do not compute the forward/backward of sequences whose group-normalised advantage is 0
    (every sample of their group scored alike). They add exactly nothing to the
    ``ppo_clip``/``tis`` loss or its gradient, so the step is the same with less work. Both
    backends; ``m2po`` always trains every sequence."""
    share_prompt: bool = True
    """Torch backend: forward each distinct prompt of a micro-batch once (a group's samples share
    theirs; an agentic group its first observation) and every sample's completion on its key/value
    cache: the same log-probs and gradients to float rounding, for less work. A micro-batch where
    it would save nothing is forwarded whole; it is off for a loss of your own (``loss_fn``) and
    turns itself off, with a warning, for a model whose cache cannot be repeated by row
    (state-space layers, sliding windows the rows do not fit in), whose cached forward fails, or
    whose log-probs disagree with the plain forward's on the first micro-batch it checks. The
    Megatron and sim backends ignore it (the Megatron backend forwards every sequence whole)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Torch backend: ``bf16`` runs the forward and backward under bf16 autocast (matrix
    products in bf16; weights, gradients, optimiser state and the log-softmax stay fp32).
    On a GPU, or a CPU with AVX-512 BF16 / AMX, the products are faster (on a CPU the
    attention then runs eager: its bf16 flash-attention backward is slower than fp32); the
    log-probs it trains on differ from the engine's fp32 ones by bf16 rounding, which the
    ratio sees as noise. ``fp32``: everything in fp32."""
    publish_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """dtype of the floating-point weights in each published version, on disk and on the wire
    (the fp32 weights the optimiser updates are not changed): ``auto`` is ``bf16`` when the
    trainer trains in bf16 (``precision: bf16``; the Megatron backend's parameters are fp32, so
    ``fp32`` there) and ``fp32`` otherwise. A bf16 version is half the bytes; a bf16 engine
    serves its values as they are, an fp32 engine upcasts them exactly. Integer tensors and
    buffers are published unchanged. Under ``storage.deltas`` nodes serve every version as
    bf16 (what the deltas rebuild), so ``auto`` is ``bf16`` there and ``fp32`` is refused: the
    committed versions are then the weights the nodes sampled with. With a narrower dtype
    the optimiser checkpoint also keeps the fp32 weights, so a resumed run continues from
    them (from the published bf16 ones only if that checkpoint is older than the version)."""

    @field_validator("advantage", "loss_fn")
    @classmethod
    def _algorithm(cls, v: str, info) -> str:
        """A built-in, or a ``module:function`` that imports and fits (imported here, so that a
        typo fails ``astraflow check``, not the trainer after the run started)."""
        from astraflow.training.algorithms import advantage_fn, loss_fn

        (advantage_fn if info.field_name == "advantage" else loss_fn)(v)
        return v

    @model_validator(mode="after")
    def _backend_settings(self) -> "TrainerConfig":
        """Settings that only one backend implements (the backends themselves do not re-check)."""
        one = "trains on one device" if self.backend == "torch" else "trains no model"  # sim would ignore it
        if self.backend != "megatron" and self.tensor_parallel != 1:
            raise ValueError(
                f"trainer.tensor_parallel {self.tensor_parallel} needs trainer.backend: megatron "
                f"(the {self.backend} backend {one}); set tensor_parallel: 1 or backend: megatron"
            )
        if self.backend != "megatron" and self.data_parallel != 1:
            raise ValueError(
                f"trainer.data_parallel {self.data_parallel} needs trainer.backend: megatron "
                f"(the {self.backend} backend {one}); set data_parallel: 1 or backend: megatron"
            )
        if self.backend == "megatron" and self.micro_batch != type(self).model_fields["micro_batch"].default:
            raise ValueError(
                f"trainer.micro_batch {self.micro_batch}: the megatron backend trains each data-parallel share in "
                "one forward and backward; raise trainer.data_parallel to shrink the share, or drop micro_batch"
            )
        if self.backend == "megatron" and self.off_policy != "ppo_clip":
            raise ValueError(
                f"trainer.off_policy {self.off_policy!r} is implemented by the torch backend only; "
                "set trainer.backend: torch or trainer.off_policy: ppo_clip"
            )
        if self.loss_fn != "grpo" and self.off_policy != "ppo_clip":
            raise ValueError(
                f"trainer.off_policy {self.off_policy!r} is a correction of the built-in loss, and trainer.loss_fn "
                f"{self.loss_fn!r} is your own (it does its own): drop off_policy, or loss_fn"
            )
        if self.backend == "megatron" and self.kl_coef:
            raise ValueError(
                f"trainer.kl_coef {self.kl_coef} is implemented by the torch backend only; "
                "set trainer.backend: torch or drop kl_coef"
            )
        if self.backend == "megatron" and self.precision != "fp32":
            raise ValueError(
                f"trainer.precision {self.precision!r} is implemented by the torch backend only; "
                "set trainer.backend: torch or trainer.precision: fp32"
            )
        return self

    @property
    def resolved_publish_dtype(self) -> Literal["fp32", "bf16"]:
        """``publish_dtype`` with ``auto`` resolved: the dtype the trainer trains in (``bf16``
        for ``precision: bf16``; the Megatron backend's parameters are fp32)."""
        if self.publish_dtype != "auto":
            return self.publish_dtype
        return "bf16" if self.backend == "torch" and self.precision == "bf16" else "fp32"

    def for_deltas(self, deltas: bool) -> "TrainerConfig":
        """This section as its trainer runs it under ``storage.deltas``: nodes that apply the
        sparse bf16 deltas serve every version rounded to bf16, so ``auto`` publishes bf16, and
        a version's committed weights are the ones its tokens were sampled with."""
        if not deltas or self.publish_dtype != "auto" or self.backend == "sim":
            return self
        return self.model_copy(update={"publish_dtype": "bf16"})


def sim_mismatch(engine_field: str, engine: str, trainer_field: str, backend: str) -> str | None:
    """Why engines of type ``engine`` (set at ``engine_field``) cannot serve a trainer of
    ``backend`` (at ``trainer_field``), or None: a sim trainer publishes versions without weights,
    which only sim engines take, and sim engines generate no tokens a real trainer could learn
    from. Sim on both sides or on neither."""
    if (engine == "sim") == (backend == "sim"):
        return None
    if backend == "sim":
        return (f"{trainer_field}: sim publishes versions without weights, which only the sim engine can take, and "
                f"{engine_field} is {engine!r}: set {engine_field}: sim, or a real trainer backend (torch, megatron)")
    return (f"{engine_field}: sim engines generate no tokens of a model, and {trainer_field} is {backend!r}, which "
            f"trains one on them: set {trainer_field}: sim (a simulated run), or a real engine type (hf, vllm)")


class PolicyConfig(Strict):
    """One policy: a model, its trainer and its weight stream."""

    name: str = "policy"
    """Policy id; names its weight stream and its buffer."""
    model: Path
    """HF model directory (a real checkpoint, or built by ``init`` when missing)."""
    init: ModelInit | None = None
    """Build the model locally if ``model`` does not exist. ``None``: the directory must exist."""
    trainer: TrainerConfig = TrainerConfig()
    """Trainer settings of this policy."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        """The name is a path component (weights, trainer state) and part of file names: bounded
        as ``run.name`` is, far below the filesystem's limit on one name."""
        if not is_plain_name(v) or len(v) > NAME_MAX:
            shown = repr(v) if len(v) <= NAME_MAX else f"{v[:20]!r}... ({len(v)} characters)"
            raise ValueError(f"policy name {shown}: use 1-{NAME_MAX} letters, digits, '_', '.', '-', starting "
                             "with a letter or digit (it names directories), e.g. 'solver'")
        return v
