"""``MegatronBackend``: the ``TrainerBackend`` that trains with Megatron-core tensor and data
parallelism.

Process layout. The trainer actor lives in one Dask worker process; a TP group needs one process
per rank, and ``dp_size`` replicas of it make ``tp_size * dp_size`` rank processes (rank
``dp_rank * tp_size + tp_rank``, Megatron's order; one GPU each on a GPU node). On one node the
backend starts the ranks itself (``python -m astraflow.training.megatron.rank``, forked from
the process's rank fork server where it can stand in, ``launch``), not with
``torch.multiprocessing.spawn``: Dask worker processes are daemonic and may not have
``multiprocessing`` children, a spawned child would re-import the worker's main module, and a
process of its own gives every rank its own log file and a pid the backend can stop by id. They
rendezvous through a ``file://`` store in the backend's private work directory (no port to
pick; made in the worker's private directory, so a worker killed outright leaves none) and log
to ``log_dir`` (a run's: ``logs/trainer-<policy>/`` of the run directory, which every node of a
job sees; else the work directory). When the trainer's Slurm job spans several nodes, the same
``rank`` module runs as one ``srun`` job step over the whole allocation, with ``env://``
rendezvous (``launch``, ``slurm``; ``launcher`` chooses).

Control channel. The backend sends every command to every rank (or, for what one replica
answers alone, to data-parallel rank 0's) and waits for every answer (``channel``). The ranks
of a TP group get identical payloads, so no broadcast is needed inside it.

Data parallelism. ``train_step`` splits the batch's rows over the replicas, balanced by token
count (``batching.balance_by_tokens``); each share's loss is normalised by the whole batch's
loss tokens and the ranks sum the gradients over the data-parallel group before the step
(``rank``), so ``dp_size`` replicas take the step one replica takes on the whole batch. The
weights stay identical on every replica.

Publish. ``publish(store, policy, version)``: every rank writes its shards of
``model.sharded_state_dict()`` with ``dist_checkpointing.save`` into the store's staging
directory, all ranks pass a barrier, then (only then) the backend calls
``store.commit(policy, version, meta)`` with ``meta = {"layout": "megatron", "hf_config": ...,
"dtype": ..., "probe": ...}`` (``probe``: what engines check their update against), which
writes the manifest and the COMMITTED marker last. A reader never sees a version whose shards
are incomplete. The ranks write their floating-point shards in
``publish_dtype`` (their own parameters stay as they are). Only data-parallel rank 0 of each
tensor-parallel rank writes shards (Megatron marks the other replicas' copies as replicas), so
a version is the same whatever ``dp_size``.

Resume. ``load_state_dict`` takes a committed version (any TP size, fp32 or bf16) or HF-named
weights, cuts each rank's shard here and sends it; ``state_dict`` gathers the shards back under
HF names (both from data-parallel rank 0; every replica gets the weights). ``optimizer_state``
is every tensor-parallel rank's AdamW state keyed by parameter name, with the parallel layout
it belongs to; it loads under any tensor- and data-parallel size (``state``: moments saved
under another tensor-parallel size are put back together and cut again). Everything loaded is
checked against the shapes the ranks reported at ``init`` before it is sent, so a refused state
raises ``ValueError`` and leaves the ranks running.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import astraflow
from astraflow.batches import Batch
from astraflow.contracts import WeightVersion
from astraflow.probe import probe_tokens
from astraflow.training.algorithms import advantage_fn, advantages
from astraflow.training.megatron.batching import (
    collate, combine_metrics, drop_zero_advantage, split_for_data_parallel, takes_num_tokens,
)
from astraflow.training.megatron.channel import RankChannel
from astraflow.training.megatron.convert import check_shard, gather_shards, shard_for_rank, to_module_state
from astraflow.training.megatron.launch import RankLaunch, start_ranks
from astraflow.training.megatron.rank_server import temporary_directory
from astraflow.training.numerics import NonFiniteError, likely_cause
from astraflow.training.megatron.slurm import Allocation
from astraflow.training.megatron.state import BACKEND as STATE_BACKEND
from astraflow.training.megatron.state import check_optimizer_state, for_tensor_parallel, layout, pack, unpack
from astraflow.weightconv import megatron_to_hf


#: the built-in loss, as the ranks import it
DEFAULT_LOSS = "astraflow.training.grpo:grpo_loss"


@dataclass(frozen=True)
class MegatronBackendConfig:
    """Configuration of the Megatron backend (owned by ``training/``)."""

    #: HF Llama checkpoint directory the run starts from (converted to Megatron at start); a
    #: relative path is made absolute against the current directory.
    hf_checkpoint: str
    #: tensor-parallel size: rank processes per model replica.
    tp_size: int = 1
    #: data-parallel size: model replicas, each training on its share of a batch; the backend
    #: starts ``tp_size * dp_size`` rank processes.
    dp_size: int = 1
    lr: float = 1e-6
    #: AdamW's, the torch backend's too: a config trains alike on either backend
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    #: PPO-style clip range of the GRPO ratio: [1 - clip_low, 1 + clip_high].
    clip_low: float = 0.2
    clip_high: float = 0.28
    #: global gradient-norm clip; 0 disables.
    max_grad_norm: float = 1.0
    seed: int = 0
    #: the loss, ``module:function`` with the signature of ``astraflow.training.grpo.grpo_loss``.
    loss_fn: str = DEFAULT_LOSS
    #: the advantage estimator (``training.algorithms``: a built-in name or ``module:function``).
    advantage: str = "grpo"
    #: torch threads per rank (CPU).
    threads_per_rank: int = 1
    #: deadline for the ranks to import Megatron, build and load the model.
    start_timeout_s: float = 300.0
    #: deadline for one command (train step, save) on every rank.
    step_timeout_s: float = 600.0
    #: where rank logs go (made absolute like ``hf_checkpoint``); None means the backend's private
    #: work directory.
    log_dir: str | None = None
    #: extra environment for the rank processes.
    env: dict[str, str] = field(default_factory=dict)
    #: do not send sequences whose advantage is 0 to the ranks: they add exactly nothing to the
    #: clipped loss or its gradient (whole GRPO groups that scored alike); the loss keeps the
    #: whole batch's token count as its normaliser, so the step is the same. Needs a ``loss_fn``
    #: that takes ``num_tokens`` (``grpo_loss`` does); with one that does not, every row trains.
    skip_zero_advantage: bool = True
    #: dtype of the published floating-point shards, ``fp32`` or ``bf16`` (the ranks' parameters
    #: are fp32 either way).
    publish_dtype: str = "fp32"
    #: how the ranks start: ``local`` (processes on the backend's own host), ``srun``
    #: (one job step over the Slurm job the backend runs in, ranks on every node of it), or
    #: ``auto``: ``srun`` inside a Slurm job of more than one node, else ``local``.
    launcher: str = "auto"
    #: fork local ranks from the process's rank fork server (``rank_server``: torch
    #: and Megatron imported once); off, each rank is a fresh interpreter.
    fork_ranks: bool = True

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tp_size ({self.tp_size}) and dp_size ({self.dp_size}) must be 1 or more")
        if self.dp_size > 1 and not takes_num_tokens(self.loss_fn):
            raise ValueError(
                f"dp_size={self.dp_size} needs a loss_fn that takes num_tokens (the whole batch's loss "
                f"tokens, which every replica's share is normalised by); {self.loss_fn} does not: add it "
                "(see astraflow.training.grpo:grpo_loss) or set trainer.data_parallel: 1"
            )
        if self.launcher not in ("auto", "local", "srun"):
            raise ValueError(f"launcher must be auto, local or srun, got {self.launcher!r}")
        if self.publish_dtype not in ("fp32", "bf16"):
            raise ValueError(f"publish_dtype must be fp32 or bf16, got {self.publish_dtype!r}")
        if ":" not in self.loss_fn:
            raise ValueError(f"loss_fn {self.loss_fn!r} must look like 'package.module:function'")
        # the ranks start in the backend's own work directory, where a relative path names nothing
        object.__setattr__(self, "hf_checkpoint", os.path.abspath(os.path.expanduser(self.hf_checkpoint)))
        if self.log_dir is not None:
            object.__setattr__(self, "log_dir", os.path.abspath(os.path.expanduser(self.log_dir)))
        if not Path(self.hf_checkpoint, "config.json").is_file():
            raise ValueError(
                f"hf_checkpoint {self.hf_checkpoint!r} has no config.json: point it at an HF model "
                "directory (save_pretrained output)"
            )


class MegatronBackend(RankChannel):
    """Tensor- and data-parallel Megatron-core trainer backend (see the module docstring)."""

    #: ``TrainerBackend`` capabilities: the weights live in the rank processes, so there is no
    #: in-process copy to publish in the background (``snapshot`` raises; the trainer does not
    #: call it). A run resumes from committed weights and its optimiser state in any TP/DP
    #: layout (``state``).
    supports_snapshot = False
    supports_resume = True
    supports_optimizer_state = True

    def __init__(self, config: MegatronBackendConfig):
        self.config = config
        world = config.tp_size * config.dp_size
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        multi_node = config.launcher == "srun" or (config.launcher == "auto" and Allocation.spans_nodes())
        # each rank takes its own GPU (NCCL); CPU-only hosts use gloo. Across nodes the
        # allocation is checked instead (``slurm.Allocation``)
        if 0 < gpus < world and not multi_node:
            raise ValueError(
                f"tensor_parallel={config.tp_size} x data_parallel={config.dp_size} needs {world} GPUs on "
                f"this node and it has {gpus}: lower trainer.tensor_parallel or trainer.data_parallel, or "
                "give the trainer partition more GPUs per node"
            )
        self._workdir = Path(tempfile.mkdtemp(prefix="astraflow-megatron-", dir=temporary_directory()))
        self._stopped = None
        log_dir = Path(config.log_dir) if config.log_dir else self._workdir
        log_dir.mkdir(parents=True, exist_ok=True)
        repo_root = str(Path(astraflow.__file__).resolve().parents[1])
        env = dict(os.environ)
        env.update(config.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", str(config.threads_per_rank))
        launch = RankLaunch(world, config.tp_size, config.dp_size, env, log_dir, self._workdir)
        try:
            self._ranks = start_ranks(config.launcher, launch, config.start_timeout_s, config.fork_ranks)
        except BaseException:
            self._drop_workdir(failed=True)
            raise
        self._conns = self._ranks.conns
        self._logs = self._ranks.logs
        try:
            cfg = asdict(config)
            cfg.pop("env")
            infos = self._call("init", cfg, config.start_timeout_s)
        except BaseException:
            self._kill("their 'init' failed")
            raise
        self.hf_config: dict[str, Any] = infos[0]["hf_config"]
        #: per rank: its tensor-parallel rank and its data-parallel replica
        self.tp_rank = [i["tp_rank"] for i in infos]
        self.dp_rank = [i["dp_rank"] for i in infos]
        #: the ranks of data-parallel replica 0, in tensor-parallel order: what answers for the model
        self.first_replica = [r for r in range(world) if self.dp_rank[r] == 0]
        #: per replica: its tensor-parallel rank 0, what answers for the replica's rows
        self.replica_heads = sorted((r for r in range(world) if self.tp_rank[r] == 0), key=self.dp_rank.__getitem__)
        assert [self.tp_rank[r] for r in self.first_replica] == list(range(config.tp_size))
        #: per tensor-parallel rank: parameter name -> shape, what a loaded state is checked
        #: against before it is sent
        self.param_shapes: list[dict[str, list[int]]] = [infos[r]["params"] for r in self.first_replica]
        # a loss of the user's may have terms without the advantage (a KL penalty): every row trains
        self.skip_zero_advantage = config.skip_zero_advantage and config.loss_fn == DEFAULT_LOSS
        self.loss_takes_num_tokens = takes_num_tokens(config.loss_fn)
        self.advantage_fn = advantage_fn(config.advantage)

    # -- TrainerBackend ----------------------------------------------------------------------
    def train_step(self, batch: Batch) -> dict[str, float]:
        dp = self.config.dp_size
        if len(batch) < dp:
            raise ValueError(
                f"a batch of {len(batch)} sequence(s) cannot be split over data_parallel={dp} replicas: "
                "raise dataflow.batch_size to at least trainer.data_parallel, or lower trainer.data_parallel"
            )
        arrays = collate(batch, advantages(self.advantage_fn, batch.items, self.config.advantage))
        trained = drop_zero_advantage(arrays) if self.skip_zero_advantage else arrays
        if "num_tokens" not in trained and self.loss_takes_num_tokens:  # a loss of the user's is told it too
            trained = {**trained, "num_tokens": float(arrays["mask"].sum())}
        if dp == 1:
            metrics = self._call("train", trained, self.config.step_timeout_s)[0]
        else:
            shares = split_for_data_parallel(trained, dp)
            answers = self._call("train", None, self.config.step_timeout_s,
                                 per_rank=[shares[d] for d in self.dp_rank])
            metrics = combine_metrics([answers[r] for r in self.replica_heads])
        # with the skip, rows without advantage count as untrained even where all are sent (a zero step)
        n = np.count_nonzero(arrays["advantages"]) if self.skip_zero_advantage else len(arrays["advantages"])
        metrics.update(num_sequences=float(len(batch)), trained_sequences=float(n))
        return metrics

    def save_shards(self, directory: str | Path) -> dict[str, float]:
        """Every rank writes its Megatron ``torch_dist`` shards into ``directory`` (created here),
        floating-point ones in ``publish_dtype``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        answers = self._call("save", {"dir": str(directory), "dtype": self.config.publish_dtype},
                             self.config.step_timeout_s)
        return {"save_s": max(a["save_s"] for a in answers)}

    def publish(self, store, policy: str, version: int, state: dict | None = None) -> WeightVersion:
        """Write shards into ``store.staging(policy, version)``, then ``store.commit`` (marker last)
        with the version's probe (``meta["probe"]``, ``astraflow.probe``). Always the ranks' current
        weights: ``state`` is for backends that ``supports_snapshot``."""
        assert state is None, "MegatronBackend publishes its ranks' weights; it takes no snapshot"
        probe = self.probe()
        if not all(math.isfinite(x) for x in probe["logprobs"]):  # weights holding nan/inf score so
            raise NonFiniteError(f"policy {policy}: not publishing v{version}, its weights give non-finite "
                                 f"log-probs of the probe sequence; {likely_cause(policy)}")
        self.save_shards(store.staging(policy, version))
        return store.commit(policy, version, {"layout": "megatron", "hf_config": self.hf_config, "train_steps": version,
                                              "dtype": self.config.publish_dtype, "probe": probe})

    def probe(self) -> dict[str, list]:
        """``meta["probe"]``: the log-probs of the probe sequence under the weights ``save_shards``
        writes. Computed where the weights already are: one tensor-parallel forward of the probe
        sequence on data-parallel replica 0 (the replicas are equal), its parameters rounded to
        ``publish_dtype`` for that forward and restored after (bf16: from a copy each rank keeps
        in host memory meanwhile), fp32 logits. This costs no gathering of the model into one
        process and no second model, and the HF <-> Megatron
        mapping is exact, so the engines, scoring the HF layout, get the same log-probs up to
        float rounding."""
        tokens = probe_tokens(int(self.hf_config["vocab_size"]))
        payload = {"tokens": tokens, "dtype": self.config.publish_dtype}
        return {"tokens": tokens,
                "logprobs": self._call("probe", payload, self.config.step_timeout_s, ranks=self.first_replica)[0]}

    def snapshot(self) -> dict:
        raise NotImplementedError("MegatronBackend.supports_snapshot is False")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The ranks' current (fp32) weights, gathered from their shards, under HF names: what the
        trainer checks for nan/inf and saves as master weights; ``load_state_dict`` takes it back."""
        shards = [unpack(b) for b in self._call("weights", None, self.config.step_timeout_s, ranks=self.first_replica)]
        return megatron_to_hf(gather_shards(shards), self.hf_config)

    def load_state_dict(self, state: dict) -> None:
        """Continue from these weights: a committed version as ``WeightStore.load`` reads it
        (Megatron checkpoint names, possibly bf16, written under any TP size), or HF-named
        weights (``state_dict``). Each rank (of every replica) gets its shard, cast to its fp32
        parameters. ``ValueError`` when they do not fit the model (the ranks are left as they
        were)."""
        full = to_module_state(state, self.hf_config)
        shards = [shard_for_rank(full, r, self.config.tp_size) for r in range(self.config.tp_size)]
        for r, (shard, shapes) in enumerate(zip(shards, self.param_shapes)):
            check_shard(shard, shapes, r)
        packed = [pack(s) for s in shards]
        self._call("load_weights", None, self.config.step_timeout_s, per_rank=[packed[t] for t in self.tp_rank])

    def optimizer_state(self) -> dict[str, Any]:
        """Every tensor-parallel rank's AdamW state keyed by parameter name (from replica 0: the
        replicas' moments are equal), with the parallel layout it belongs to (``state``
        describes the record)."""
        answers = self._call("optimizer_state", None, self.config.step_timeout_s, ranks=self.first_replica)
        return {"backend": STATE_BACKEND, "layout": layout(self.config.tp_size, self.config.dp_size),
                "ranks": [unpack(b) for b in answers]}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Continue with saved moments, every replica with its tensor-parallel rank's record
        (saved under any ``dp_size``; under another ``tp_size``, cut again for this one).
        ``ValueError`` (the ranks untouched) when they are another model's; the hyperparameters
        stay this backend's (a resumed run may change ``lr``)."""
        state = for_tensor_parallel(state, self.config.tp_size)
        check_optimizer_state(state, self.param_shapes, self.config.dp_size)
        packed = [pack(rec) for rec in state["ranks"]]
        self._call("load_optimizer_state", None, self.config.step_timeout_s, per_rank=[packed[t] for t in self.tp_rank])

    def logprobs(self, tokens: np.ndarray) -> np.ndarray:
        """``log p(tokens[:, t+1] | tokens[:, :t+1])``, shape ``[B, T-1]`` (evaluation, no grad;
        the rows split in order over the replicas)."""
        tokens = np.asarray(tokens, np.int64)
        if self.config.dp_size == 1:
            return self._call("logprobs", {"tokens": tokens}, self.config.step_timeout_s)[0]
        parts = np.array_split(tokens, self.config.dp_size)
        answers = self._call("logprobs", None, self.config.step_timeout_s,
                             per_rank=[{"tokens": parts[d]} for d in self.dp_rank])
        return np.concatenate([answers[r] for r in self.replica_heads])

    def close(self) -> None:
        """Stop the ranks and remove the work directory (after a failure it stays where the logs
        the error points at are in it, ``_drop_workdir``). Nothing to do once they were stopped."""
        if not self._conns:
            return
        try:
            self._call("stop", None, 60.0)
            self._ranks.wait(30)
        finally:
            self._kill("the backend was closed")
        self._drop_workdir(failed=False)

    def __enter__(self) -> "MegatronBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
