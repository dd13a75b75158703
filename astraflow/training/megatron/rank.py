"""One rank of the Megatron backend (a tensor-parallel rank of one data-parallel replica), run
as its own process.

``MegatronBackend`` (in the trainer actor's process) starts ``tp_size * dp_size`` of these with
``python -m astraflow.training.megatron.rank`` (as processes of its own node, or as one srun job
step across nodes) and talks to each through a private channel (``launch.rank_channel``: an
authenticated connection back to the backend, over a Unix socket or, under srun, TCP). Local
ranks are forked from a server that imported this module and Megatron once (``rank_server``).
Every rank receives the same command stream; the ranks of one data-parallel replica get the
same payload, so a tensor-parallel step needs no extra broadcast and every rank can report its
own progress.

Data parallelism (``dp_size > 1``): each replica trains on its share of the batch and
Megatron-core's ``DistributedDataParallel`` wrapper (contiguous gradient buffer, one all-reduce
over the data-parallel group after the backward, no overlap) sums the replicas' gradients
before the global-norm clip and the AdamW step; every replica then takes the same step. The
gradients are summed, not averaged, because each share's loss is already normalised by the
whole batch's token count (``batching``). The optimiser stays ``torch.optim.AdamW`` on every
replica (moments replicated, the ``state`` record unchanged). Megatron's distributed optimizer,
which shards the moments over the replicas, is not used: it replaces this AdamW and its
per-parameter record, and a saved state would then be cut for one data-parallel size.

Commands (``(name, payload)`` tuples; each is answered with ``("ok", result)``):

* ``init``: build the model from the HF checkpoint, create the optimiser, report parameter counts;
* ``train``: one GRPO step on this replica's share of a collated batch (numpy arrays; may have
  no rows), returns metrics;
* ``logprobs``: per-token log-probs of ``tokens[:, 1:]`` given the prefix (no grad; each replica
  gets its own rows);
* ``probe``: the log-probs of one token sequence under the weights as ``save`` writes them
  (parameters rounded to the payload's ``dtype`` for the forward, then restored bit for bit);
  sent to the tensor-parallel group of data-parallel replica 0 only;
* ``save``: ``dist_checkpointing.save(model.sharded_state_dict(), dir)`` on every rank (floating
  shards cast to the payload's ``dtype``), then a barrier. Megatron marks the shards of
  data-parallel rank > 0 as replicas, so only data-parallel rank 0 writes them;
* ``weights`` / ``load_weights``: this rank's parameters out / in (``state.pack``ed bytes; the
  backend sends each rank its own shard, checked against the shapes ``init`` reported);
* ``optimizer_state`` / ``load_optimizer_state``: this rank's AdamW state keyed by parameter
  name (``state.named_optimizer_state``), out / in;
* ``stop``: tear down the process group and exit.

A failure raises out of the loop: the process exits non-zero with the traceback in its log, and
the parent, which watches every rank's pid, reports it and stops the other ranks. A command
that failed on a full disk (found anywhere in its error's chain, e.g. inside the
``CheckpointException`` a ``save`` raises on every rank) is answered with
``("full_disk", (errno, strerror, filename))`` instead and the rank goes on: the parent raises
that ``OSError``, so the run ends as any full disk ends it, resumable.
"""

from __future__ import annotations

import errno
import os
import queue
import time
from contextlib import contextmanager

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from astraflow.training.megatron.state import load_named_optimizer_state, named_optimizer_state, pack, unpack
from astraflow.training.optim import adamw
from storage.full_disk import full_disk_in


def _cast_shards(sharded: dict, dtype: torch.dtype) -> dict:
    """A sharded state dict whose floating-point tensors are copies in ``dtype`` (factories
    built first, so that the saved tensors are what gets cast); the model is not touched."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)

    def cast(x):
        if isinstance(x, ShardedTensor) and x.data is not None and x.data.is_floating_point():
            return replace(x, data=x.data.to(dtype), dtype=dtype)
        return x

    return dict_list_map_inplace(cast, sharded)


@contextmanager
def rounded_parameters(model: torch.nn.Module, dtype: torch.dtype):
    """The model's floating-point parameters rounded to ``dtype`` (and kept in their own dtype)
    while the block runs, as ``_cast_shards`` publishes them; restored exactly afterwards from a
    copy in host memory (so the device needs no second copy). A no-op for the parameters' own
    dtype."""
    params = [p for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
    saved = [p.detach().to("cpu", copy=True) for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.copy_(p.to(dtype))
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def wrap_data_parallel(model):
    """Megatron-core's ``DistributedDataParallel`` around ``model`` (the parameters stay the
    model's; their gradients go to one contiguous ``main_grad`` buffer per dtype, reduced with
    one all-reduce in ``finish_grad_sync``). ``calculate_per_token_loss`` makes the reduction a
    sum: the loss is already normalised by the whole batch's token count."""
    from dataclasses import replace

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    return DistributedDataParallel(replace(model.config, calculate_per_token_loss=True), ddp_config, model)


def collective_timeout_s(cfg: dict) -> float:
    """The process group's timeout: the backend's deadline for a command (``step_timeout_s``),
    or for the start (``start_timeout_s``) when longer. A collective that waits for a slow rank
    (the save barrier, a checkpoint's gather) then fails no sooner than the backend gives up on
    the command, which reports the late rank."""
    return max(float(cfg["step_timeout_s"]), float(cfg["start_timeout_s"]))


def resolve(dotted: str):
    """``"package.module:attr"`` -> the attribute (loss functions are chosen by name in the config)."""
    from astraflow.training.algorithms import loss_by_name

    if ":" not in dotted:
        raise ValueError(f"loss_fn {dotted!r} must look like 'package.module:function'")
    return loss_by_name(dotted)  # as the config found it: from the user's directory or package too


class Rank:
    def __init__(self, spec, cfg: dict):
        from megatron.core import parallel_state

        from astraflow.training.megatron.convert import load_hf_checkpoint, load_hf_state_into
        from astraflow.training.megatron.model import build_gpt_model, init_distributed

        torch.set_num_threads(int(cfg.get("threads_per_rank", 1)))
        self.loss_fn = resolve(cfg["loss_fn"])  # fail before the expensive part
        self.spec = spec
        self.cfg = cfg
        self.device = init_distributed(spec, timeout_s=collective_timeout_s(cfg))
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        assert spec.rank == self.dp_rank * spec.tp_size + self.tp_rank, "Megatron's rank order changed"
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        hf_sd, hf_config = load_hf_checkpoint(cfg["hf_checkpoint"])
        self.hf_config = hf_config.to_dict()
        self.model = build_gpt_model(hf_config, spec.tp_size, seed=int(cfg.get("seed", 0)))
        # every replica loads the same weights: they start, and stay, equal
        load_hf_state_into(self.model, hf_sd, hf_config, self.tp_rank, spec.tp_size)
        del hf_sd
        self.model.to(self.device)
        self.ddp = wrap_data_parallel(self.model) if spec.dp_size > 1 else None
        self.opt = adamw(self.model.parameters(), lr=float(cfg["lr"]), betas=tuple(cfg.get("betas", (0.9, 0.99))),
                         weight_decay=float(cfg.get("weight_decay", 0.0)))

    # -- compute ---------------------------------------------------------------------------
    def _token_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < T-1, shape [B, T-1]; right padding is
        harmless under the causal mask. The vocab-parallel cross entropy returns the full value
        on every tensor-parallel rank."""
        inp, labels = tokens[:, :-1], tokens[:, 1:]
        b, s = inp.shape
        pos = torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), 1)[None, None]
        return -self.model(inp, pos, causal, labels=labels).float()

    def logprobs(self, payload: dict) -> np.ndarray:
        if not len(payload["tokens"]):  # a replica with no rows of this request
            return np.zeros((0, max(np.shape(payload["tokens"])[1] - 1, 0)), np.float32)
        self.model.eval()
        with torch.no_grad():
            lp = self._token_logprobs(torch.as_tensor(payload["tokens"], dtype=torch.long, device=self.device))
        return lp.cpu().numpy()

    def probe(self, payload: dict) -> list[float]:
        """``log p(tokens[i] | tokens[:i])`` for ``i >= 1`` of ``payload["tokens"]`` (one
        sequence) under the parameters rounded to ``payload["dtype"]``, computed in fp32: the
        ``astraflow.probe`` definition, on the weights a version published in that dtype holds."""
        dtype = torch.bfloat16 if payload.get("dtype", "fp32") == "bf16" else torch.float32
        with rounded_parameters(self.model, dtype):
            lp = self.logprobs({"tokens": np.asarray([payload["tokens"]], np.int64)})
        return [float(x) for x in lp[0]]

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient: TP-sharded parameters summed over the tensor-parallel
        group, replicated ones (norms) counted once. Called after the data-parallel reduction,
        so every replica gets the same norm."""
        import torch.distributed as dist

        sharded = torch.zeros((), device=self.device)
        replicated = torch.zeros((), device=self.device)
        for p in self.model.parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.spec.tp_size > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        return (sharded + replicated).sqrt()

    def train(self, payload: dict) -> dict:
        t0 = time.perf_counter()
        self.model.train()
        dev = self.device
        tokens = torch.as_tensor(payload["tokens"], dtype=torch.long, device=dev)
        mask = torch.as_tensor(payload["mask"], dtype=torch.float32, device=dev)
        old = torch.as_tensor(payload["old_logprobs"], dtype=torch.float32, device=dev)
        adv = torch.as_tensor(payload["advantages"], dtype=torch.float32, device=dev)
        self.opt.zero_grad(set_to_none=True)
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        if len(tokens):
            new = self._token_logprobs(tokens)
            # a share of the batch, or rows without advantage left out by the backend: normalise
            # by the whole batch's tokens
            extra = {"num_tokens": float(payload["num_tokens"])} if "num_tokens" in payload else {}
            out = self.loss_fn(new, old, adv, mask, float(self.cfg["clip_low"]), float(self.cfg["clip_high"]), **extra)
            loss, stats = (out[0], dict(out[1])) if isinstance(out, tuple) else (out, {})
            loss.backward()
        else:  # a replica without rows: zero gradients into the reduction, no statistics
            new, loss, stats = torch.zeros_like(old), torch.zeros(()), {}
        if self.ddp is not None:
            self.ddp.finish_grad_sync()  # sum over the data-parallel group, into main_grad
            for p in self.model.parameters():
                p.grad = p.main_grad
        gnorm = self._grad_norm()
        # the norm is global (after the reductions): every rank skips a non-finite step alike,
        # which changes no weight (nor the optimiser's moments)
        finite = bool(torch.isfinite(gnorm))
        max_norm = float(self.cfg.get("max_grad_norm", 0.0))
        if max_norm > 0 and finite and gnorm > max_norm:
            scale = max_norm / (gnorm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        if finite:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        m = {k: float(v) for k, v in stats.items()}
        m["nonfinite_skipped"] = float(not finite)
        with torch.no_grad():
            ntok = mask.sum().clamp_min(1)
            m["entropy_proxy"] = float(-(new.detach() * mask).sum() / ntok)
            m["mismatch_kl"] = float(((old - new.detach()) * mask).sum() / ntok)
        m.update(loss=float(loss.detach()), grad_norm=float(gnorm), tokens=float(mask.sum()),
                 step_s=time.perf_counter() - t0)
        return m

    def save(self, payload: dict) -> dict:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        t0 = time.perf_counter()
        _write_results_in_process()
        sharded = self.model.sharded_state_dict()
        if payload.get("dtype", "fp32") == "bf16":
            sharded = _cast_shards(sharded, torch.bfloat16)
        try:
            dist_checkpointing.save(sharded, payload["dir"])
        except _FAILURES as err:
            # the shard writers report a short write without its errno: a filesystem left with
            # (almost) no room after the failed save is taken to be why
            if full_disk_in(err) is None and _free_bytes(payload["dir"]) < NEARLY_FULL_BYTES:
                last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                raise OSError(errno.ENOSPC, f"No space left on device (the shards could not be written: {last})",
                              payload["dir"]) from err
            raise
        dist.barrier()
        return {"save_s": time.perf_counter() - t0}

    def weights(self, payload: None) -> bytes:
        return pack({k: v.detach().cpu() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)})

    def load_weights(self, payload: bytes) -> None:
        from astraflow.training.megatron.convert import load_shard_into

        load_shard_into(self.model, unpack(payload), self.tp_rank)

    def optimizer_state(self, payload: None) -> bytes:
        return pack(named_optimizer_state(self.model, self.opt))

    def load_optimizer_state(self, payload: bytes) -> None:
        load_named_optimizer_state(self.model, self.opt, unpack(payload))

    def info(self) -> dict:
        return {"rank": self.spec.rank, "tp_rank": self.tp_rank, "dp_rank": self.dp_rank, "hf_config": self.hf_config,
                "params": {k: list(p.shape) for k, p in self.model.named_parameters()}}


def main() -> None:
    from astraflow.training.megatron.launch import rank_channel, rank_spec
    from astraflow.training.megatron.model import DistSpec, shutdown_distributed
    from storage.ownership import add_user_dir

    add_user_dir()  # a user's loss function from the working directory of `astraflow`, after installed modules
    spec = DistSpec(**rank_spec())
    conn = rank_channel(spec.rank)
    cmd, cfg = conn.recv()
    if cmd != "init":
        raise ValueError(f"rank {spec.rank}: first command must be 'init', got {cmd!r}")
    rank = Rank(spec, cfg)
    conn.send(("ok", rank.info()))
    handlers = {"train": rank.train, "logprobs": rank.logprobs, "probe": rank.probe, "save": rank.save,
                "weights": rank.weights, "load_weights": rank.load_weights, "optimizer_state": rank.optimizer_state,
                "load_optimizer_state": rank.load_optimizer_state}
    while True:
        cmd, payload = conn.recv()  # EOFError if the parent died: the process exits with it
        if cmd == "stop":
            shutdown_distributed()
            conn.send(("ok", None))
            return
        if cmd not in handlers:
            raise ValueError(f"unknown command {cmd!r}; known: {sorted(handlers) + ['stop']}")
        try:
            answer = ("ok", handlers[cmd](payload))
        except _FAILURES as err:
            full = full_disk_in(err)
            if full is None:
                raise
            answer = ("full_disk", (full.errno, full.strerror, None if full.filename is None else str(full.filename)))
        conn.send(answer)


#: what a command's failure may be: any error, and torch's ``CheckpointException`` (a
#: ``BaseException``); not an interrupt
_FAILURES = (Exception, CheckpointException)

#: free space under which a failed save is put down to a full filesystem
NEARLY_FULL_BYTES = 16 * 1024 * 1024


def _write_results_in_process() -> None:
    """Megatron-core's shard writer passes its results through a queue that by default lives in
    a spawned manager process, made for saves that finish in another process: started at a
    rank's first save, it imports torch and this module again and stays as long as the rank.
    ``save`` here is synchronous (the writer puts and takes in this process), so a plain queue
    serves (an asynchronous save, which this rank never makes, would need the manager's); a
    Megatron-core without that queue keeps its own."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", ...) is None:
        filesystem_async._results_queue = queue.Queue()


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return NEARLY_FULL_BYTES  # not there to ask: not known to be full
    return st.f_bavail * st.f_frsize


if __name__ == "__main__":
    main()
