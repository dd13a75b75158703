"""``TorchBackend``: the plain-PyTorch trainer backend (CPU or one GPU).

Owns one HF causal LM and its AdamW optimiser and implements ``TrainerBackend``: a
``train_step`` is one optimiser step over a whole ``Batch`` (split into micro-batches of at
most ``micro_batch_size`` sequences, gradients accumulated, the token-level GRPO loss
normalised by the loss tokens of the whole batch), with gradient-norm clipping. A step whose
loss or gradient norm is not finite changes no weight (``training.numerics``: counted in its
metrics; the trainer stops after too many in a row), and ``publish`` refuses weights that are
not finite. Sequences with advantage 0 add exactly nothing to the ``ppo_clip``/``tis`` loss or
its gradient and are not computed (``skip_zero_advantage``; early in GRPO whole groups score
alike); the loss statistics are then over the trained sequences. ``kl_coef`` adds GRPO's KL
penalty to the model the trainer started from (a frozen copy, one more forward per micro-batch;
every sequence is then trained). Each distinct prompt of a micro-batch is forwarded once, its
key/value cache repeated for the samples that share it (``share_prompt``, ``training.prefix``;
``forwarded_tokens`` in the metrics counts the tokens the step's forwards ran on, padding, a KL
reference's and M2PO's first pass included).
``precision="bf16"`` runs the forward/backward under bf16 autocast (the weights, gradients and
AdamW state stay fp32).
``publish`` hands the current weights, under their HF names, to the weight store, the
parameters cast to ``publish_dtype`` (``bf16`` halves every version; the fp32 master weights
stay as they are).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Literal

import torch

from astraflow.batches import Batch
from astraflow.probe import make_probe
from astraflow.training.algorithms import advantages, user_loss
from astraflow.training.grpo import collate, grpo_loss, m2_keep_mask
from astraflow.training.prefix import PrefixSharing
from astraflow.training.numerics import refuse_nonfinite
from astraflow.training.optim import adamw


class TorchBackend:
    """Plain-PyTorch GRPO trainer backend. ``model_path``: an HF causal-LM directory. Its
    settings are validated by ``TrainerConfig`` (``make_backend`` passes them on)."""

    #: ``TrainerBackend`` capabilities: all of them.
    supports_snapshot = True
    supports_resume = True
    supports_optimizer_state = True

    def __init__(
        self,
        model_path: str,
        lr: float = 1e-4,
        *,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        grad_clip: float = 1.0,
        micro_batch_size: int | None = None,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        device: str = "auto",
        seed: int = 0,
        off_policy: Literal["ppo_clip", "tis", "m2po"] = "ppo_clip",
        is_cap: float = 2.0,
        m2_tau: float = 0.04,
        skip_zero_advantage: bool = True,
        precision: Literal["fp32", "bf16"] = "fp32",
        publish_dtype: Literal["auto", "fp32", "bf16"] = "auto",
        advantage: str = "grpo",
        loss_fn: str = "grpo",
        kl_coef: float = 0.0,
        share_prompt: bool = True,
    ) -> None:
        from astraflow.models import load_model, resolve_device, warn_if_bf16_is_emulated
        from astraflow.training.algorithms import advantage_fn, is_builtin_loss
        from astraflow.training.algorithms import loss_fn as resolve_loss

        #: the advantage estimator and, where the config names its own, the loss (``training.algorithms``)
        self.advantage_name, self.advantage_fn = advantage, advantage_fn(advantage)
        self.loss_name = loss_fn
        self.custom_loss = None if is_builtin_loss(loss_fn) else resolve_loss(loss_fn)

        #: off-policy correction of the loss (``grpo.grpo_loss``) and its parameters
        self.off_policy, self.is_cap, self.m2_tau = off_policy, is_cap, m2_tau
        #: ``bf16``: forward and backward under bf16 autocast (fp32 weights, grads, optimiser)
        self.precision = precision
        #: dtype of the published parameters (``auto``: the one the forward/backward runs in)
        self.publish_dtype = (("bf16" if precision == "bf16" else "fp32") if publish_dtype == "auto"
                              else publish_dtype)
        #: skip the forward/backward of sequences whose advantage is 0 (same step, less work)
        self.skip_zero_advantage = skip_zero_advantage
        #: each distinct prompt of a micro-batch forwarded once (``training.prefix``); not for a
        #: loss of the user's, which may read the log-probs of prompt tokens
        self.prefix = PrefixSharing(share_prompt and self.custom_loss is None)
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_model(model_path)
        self.device = resolve_device(device)
        self.model.to(self.device)
        if precision == "bf16":
            warn_if_bf16_is_emulated(self.device, "policies[].trainer.precision")
        if precision == "bf16" and self.device.type == "cpu":
            # the CPU's bf16 flash-attention backward is far slower than its fp32 one (it costs
            # more than the bf16 products gain); eager attention is a bf16 bmm + softmax
            self.model.set_attn_implementation("eager")
        #: the KL penalty's weight and its reference, a frozen copy of the model it starts from
        #: (``model_path``, attention set up alike: a resumed run's trainer loads its newest
        #: version over the model, not over the reference)
        self.kl_coef, self.reference = kl_coef, None
        if kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.clip_low, self.clip_high = clip_low, clip_high
        self.optimizer = adamw(self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
        #: steps skipped because their loss or gradient norm was not finite (in all)
        self.nonfinite_skipped = 0
        #: every name a parameter has in ``state_dict()`` (a tied head under both of its names);
        #: only these are cast for publishing: buffers and integer tensors go out as they are
        self._param_names = {k for k, _ in self.model.named_parameters(remove_duplicate=False)}

    def train_step(self, batch: Batch) -> dict[str, float]:
        t0, forwarded = time.perf_counter(), self.prefix.forwarded
        # eval mode for the policy-gradient pass too: with dropout on, the new log-probs of an
        # on-policy batch would differ from the engine's (a ratio away from 1, clipped at random)
        self.model.eval()
        c = collate(batch, self.pad_id, advantages(self.advantage_fn, batch.items, self.advantage_name))
        total_tokens = int(c.loss_mask.sum())  # the loss is normalised by all of them, trained or not
        B = c.tokens.shape[0]
        rows = torch.arange(B)
        if self.skip_zero_advantage and self.off_policy != "m2po" and self.custom_loss is None and not self.kl_coef:
            # a sequence with advantage 0 (a group whose samples all scored alike) contributes
            # exactly 0 to the ppo_clip / tis loss and its gradient: skip its forward/backward.
            # (m2po's token mask depends on every token's ratio, so it trains on all rows; a KL
            # penalty, or a loss of the user's, has terms without the advantage.)
            rows = torch.nonzero(c.advantages != 0).flatten()
        trained_tokens = int(c.loss_mask[rows].sum())
        mb = self.micro_batch_size or B
        keep = self._m2_batch_mask(c, rows, mb) if self.off_policy == "m2po" and len(rows) > mb else None
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        agg: dict[str, float] = {}  # the loss's diagnostics over the trained tokens (none trained: absent)
        for s in range(0, len(rows), mb):
            sl = rows[s : s + mb]
            # trim right padding of this micro-batch
            width = int(c.attention_mask[sl].sum(-1).max())
            tok = c.tokens[sl, :width].to(self.device)
            att = c.attention_mask[sl, :width].to(self.device)
            lm = c.loss_mask[sl, :width].to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
                new = self.prefix.logprobs(self.model, tok, att, lm)  # its log-softmax is fp32 either way
            old, adv = c.old_logprobs[sl, :width].to(self.device), c.advantages[sl].to(self.device)
            if self.custom_loss is not None:
                loss, st = user_loss(self.custom_loss, self.loss_name, new, old, adv, lm, self.clip_low,
                                     self.clip_high, total_tokens)
            else:
                loss, st = grpo_loss(
                    new, old, adv, lm, self.clip_low, self.clip_high, num_tokens=total_tokens,
                    off_policy=self.off_policy, is_cap=self.is_cap, m2_tau=self.m2_tau,
                    keep_mask=None if keep is None else keep[sl, :width].to(self.device),
                )
            if self.reference is not None:
                kl = self._kl_to_reference(new, tok, att, lm)
                loss = loss + self.kl_coef * kl.sum() / max(total_tokens, 1)
                st = {**st, "kl_ref": float(kl.detach().sum()) / max(float(lm.sum()), 1.0)}
            loss.backward()
            loss_sum += loss.item()
            w = float(lm.sum()) / max(trained_tokens, 1)
            for k in st:
                agg[k] = agg.get(k, 0.0) + st[k] * w
        if len(rows) == 0:  # nothing trained: the step still sees the zero gradient it would have
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        finite = math.isfinite(loss_sum) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        else:  # no weight (nor optimiser moment) takes a nan/inf: drop the gradient
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_skipped += 1
        self.model.eval()
        return {
            "loss": loss_sum,
            "grad_norm": float(grad_norm),
            **agg,
            "num_tokens": float(total_tokens),
            "num_sequences": float(B),
            "trained_sequences": float(len(rows)),
            "forwarded_tokens": float(self.prefix.forwarded - forwarded),
            "reward_mean": float(c.rewards.mean()),
            "advantage_abs_mean": float(c.advantages.abs().mean()),
            "nonfinite_skipped": float(not finite),
            "nonfinite_skipped_total": float(self.nonfinite_skipped),
            "seconds": time.perf_counter() - t0,
        }

    def _kl_to_reference(self, new: torch.Tensor, tok: torch.Tensor, att: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
        """Per loss token, the k3 estimate of KL(policy || reference): ``exp(d) - d - 1`` with
        ``d = ref - new`` (never negative, unbiased; GRPO's penalty), 0 off the mask."""
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16,
                                             enabled=self.precision == "bf16"):
            ref = self.prefix.logprobs(self.reference, tok, att, mask)
        # off the mask 0 (a prompt token's gap may be huge: exp of it would make inf * 0 = nan),
        # and bounded, as a ratio this far from 1 would be clipped anyway
        d = torch.where(mask.bool(), ref.float() - new.float(), 0.0).clamp(-20.0, 20.0)
        return torch.exp(d) - d - 1

    def _m2_batch_mask(self, c, rows: torch.Tensor, mb: int) -> torch.Tensor:
        """M2PO's keep mask over the whole batch (``[B, T]``, CPU): every micro-batch's log
        ratios from a forward pass without gradients, then ``m2_keep_mask`` over all of them."""
        log_ratio = torch.zeros(c.old_logprobs.shape, dtype=torch.float32)
        with torch.no_grad():
            for s in range(0, len(rows), mb):
                sl = rows[s : s + mb]
                width = int(c.attention_mask[sl].sum(-1).max())
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
                    new = self.prefix.logprobs(self.model, c.tokens[sl, :width].to(self.device),
                                               c.attention_mask[sl, :width].to(self.device),
                                               c.loss_mask[sl, :width].to(self.device))
                log_ratio[sl, :width] = (new.float().cpu() - c.old_logprobs[sl, :width])
        return m2_keep_mask(log_ratio, c.loss_mask, self.m2_tau)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current (master, fp32) weights under their HF names (detached CPU tensors)."""
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from committed weights (a resumed run; ``load_optimizer_state`` restores
        the optimiser's moments, else they start fresh). A bf16 version is upcast into the
        fp32 parameters; a version the megatron backend published (its checkpoint names) is
        converted to HF names first, so a run may change backends when it resumes."""
        from astraflow.weightconv import is_checkpoint_layout, megatron_to_hf

        if is_checkpoint_layout(state):
            state = megatron_to_hf(state, self.model.config)
        self.model.load_state_dict(state)  # copies into the parameters, casting to their dtype

    def optimizer_state(self) -> dict[str, Any]:
        """The optimiser's state (moments, step counts, hyperparameters), for a checkpoint."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Continue with saved optimiser moments (``ValueError`` if they belong to another
        model); the hyperparameters stay this backend's (a resumed run may change ``lr``)."""
        own = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        saved = state["param_groups"]
        if len(saved) == len(own):  # else torch refuses it, naming the groups
            # loaded with these groups: torch places step counts by them (a fused group's on its
            # parameters' device; a state saved by the unfused AdamW keeps them on the CPU)
            state = {**state, "param_groups": [{**g, **mine} for g, mine in zip(saved, own)]}
        self.optimizer.load_state_dict(state)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the current weights as they are published (CPU, parameters in
        ``publish_dtype``), unaffected by later steps: the trainer publishes it in a helper
        thread while the next step trains."""
        snap = _Snapshot(self._for_publish(self.model.state_dict(), copy=True))
        snap.probe = make_probe(self.model, snap)  # now: the model trains on while the copy is published
        return snap

    def _for_publish(self, state: dict[str, torch.Tensor], copy: bool = False) -> dict[str, torch.Tensor]:
        """``state`` on the CPU with its floating-point parameters in ``publish_dtype``."""
        dtype = torch.bfloat16 if self.publish_dtype == "bf16" else torch.float32
        return {k: v.detach().to("cpu", dtype if k in self._param_names and v.is_floating_point() else v.dtype,
                                 copy=copy)
                for k, v in state.items()}

    def publish(self, store, policy: str, version: int, state: dict[str, torch.Tensor] | None = None):
        """``store.publish(policy, version, weights, meta)`` with ``state`` (a ``snapshot()``)
        or else the current weights, parameters in ``publish_dtype`` (``meta["dtype"]``), and
        the log-probs of the probe sequence under them (``meta["probe"]``, ``astraflow.probe``);
        returns its ``WeightVersion``. ``NonFiniteError`` instead when a weight is nan/inf."""
        meta: dict[str, Any] = {
            "layout": "hf",
            "arch": self.model.config.model_type,
            "config": self.model.config.to_dict(),
            "train_steps": version,  # the trainer's version counts the run's optimiser steps
            "dtype": self.publish_dtype,
        }
        weights = self._for_publish(self.model.state_dict() if state is None else state)
        refuse_nonfinite(weights, policy, version)
        # the probe engines check their update against: from exactly the published tensors
        meta["probe"] = getattr(state, "probe", None) or make_probe(self.model, weights)
        return store.publish(policy, version, weights, meta=meta)

    def save(self, out_dir: str) -> None:
        """Write the current model and tokenizer as an HF directory."""
        self.model.save_pretrained(out_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(out_dir)

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class _Snapshot(dict):
    """``snapshot()``'s copy of the weights, with the probe computed when it was taken."""

    probe: dict | None = None
