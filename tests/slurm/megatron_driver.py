"""What the multi-node Megatron test runs where a trainer runs: a TP=1 x DP=2 ``MegatronBackend``
that takes one GRPO step and publishes it. The test calls ``train_once`` in its own process
(the local launcher) and, through Dask, in the worker of a 2-node trainer job (srun);
``start_with_a_failing_rank`` starts ranks of which rank 1 fails while it builds."""

from __future__ import annotations

import os
from pathlib import Path

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig
from storage.checkpoint import read_checkpoint
from tests.megatron.helpers import MiniStore, grpo_batch, loss_fn_name, prompts


def train_once(hf_dir: str, out_dir: str, launcher: str, timeout_s: float = 400) -> dict:
    """One step and a publish at TP=1 x DP=2 under ``launcher``; the weights after it, the
    published version, and where the ranks ran (srun: their hosts, pids, job step, srun line)."""
    cfg = MegatronBackendConfig(hf_checkpoint=hf_dir, tp_size=1, dp_size=2, lr=1e-3, loss_fn=loss_fn_name(),
                                launcher=launcher, start_timeout_s=timeout_s, step_timeout_s=timeout_s,
                                log_dir=str(Path(out_dir) / "logs"), env={"GLOO_SOCKET_IFNAME": "lo"})
    tokens = prompts(batch=4, length=12)
    with MegatronBackend(cfg) as be:
        ranks = be._ranks
        batch = grpo_batch(tokens, be.logprobs(tokens), prompt_len=4)
        metrics = be.train_step(batch)
        state = be.state_dict()
        version = be.publish(MiniStore(Path(out_dir) / "weights"), "p", 1)
    out = {"metrics": metrics, "state": state,
           "published": read_checkpoint(Path(version.manifest_path).parent),
           "launcher": type(ranks).__name__}
    if hasattr(ranks, "proc"):
        out.update(command=ranks.command, where=ranks.where, step=ranks.step, srun_returncode=ranks.proc.returncode)
    return out


def __getattr__(name: str):
    """``loss_failing_on_rank_1``: the GRPO loss, except that rank 1 fails when it looks it up
    (the rank resolves its loss by name first thing), while rank 0 goes on to the rendezvous."""
    if name != "loss_failing_on_rank_1":
        raise AttributeError(name)
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1 fails on purpose")
    from tests.megatron.helpers import grpo_loss_fallback

    return grpo_loss_fallback


def start_with_a_failing_rank(hf_dir: str, out_dir: str, timeout_s: float = 400) -> str:
    """Start TP=2 ranks (one per node) of which rank 1 fails: the backend's error message."""
    cfg = MegatronBackendConfig(hf_checkpoint=hf_dir, tp_size=2, dp_size=1, launcher="srun",
                                loss_fn=f"{__name__}:loss_failing_on_rank_1", start_timeout_s=timeout_s,
                                log_dir=str(Path(out_dir) / "logs"), env={"GLOO_SOCKET_IFNAME": "lo"})
    try:
        MegatronBackend(cfg).close()
    except Exception as err:  # RankError expected; anything else is reported as it is
        return f"{type(err).__name__}: {err}"
    return "no error"
