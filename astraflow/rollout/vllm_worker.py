"""The part of the vLLM engine that runs inside vLLM's worker processes.

vLLM's weight-transfer protocol for RL (``AsyncLLM.start_weight_update`` /
``update_weights`` / ``finish_weight_update``) hands each worker an ``update_info`` dict and
lets a registered *weight-transfer engine* turn it into tensors. Ours, ``astraflow_store``,
reads the tensors from the weight store itself: ``update_info`` is only the store's root,
the policy and the version (and how to read it: full shards or a delta on the version the
worker read last). So only a version number crosses the process boundary, also with tensor
parallelism (every rank reads the version and ``model.load_weights`` keeps its shard).

The module registers the backend when it is imported. vLLM imports it in every worker
because the engine names ``WorkerExtension`` as its ``worker_extension_cls``; the frontend
imports it too (``vllm_engine``), where registration lets vLLM's config accept the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

#: the name of the backend in ``WeightTransferConfig(backend=...)``
BACKEND = "astraflow_store"


def _ask_for_amx() -> None:
    """On a CPU with AMX, Linux lets a process use the tile registers only once it asked
    (``arch_prctl``). torch asks when its own kernels first need them; the CPU build's attention
    kernel does not, so a bf16 engine's worker died of SIGILL on its first request. Asked here,
    in every worker, before anything runs; a no-op where there is no AMX or no CPU build."""
    import torch

    ask = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if ask is not None and not torch.cuda.is_available():
        try:
            ask()
        except Exception:  # an older torch, or a kernel that refuses: the fp32 path needs none of it
            pass


_ask_for_amx()


@dataclass
class StoreInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the weight store is a directory every worker can read."""


@dataclass
class StoreUpdateInfo(WeightTransferUpdateInfo):
    """One committed version to read (what crosses the process boundary)."""

    weights_root: str
    policy: str
    version: int
    use_deltas: bool = False
    full_resync_every: int = 10


class StoreWeightTransferEngine(WeightTransferEngine[StoreInitInfo, StoreUpdateInfo]):
    """Reads committed versions from the weight store (``weight_sync.VersionReader``: full
    shards or held version + sparse delta, Megatron layouts converted to HF names) and loads
    them through vLLM's layerwise reload (``start``/``finish`` wrap the load so that kernels'
    repacked weights are processed again, as for a checkpoint load)."""

    init_info_cls = StoreInitInfo
    update_info_cls = StoreUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._readers: dict[tuple, Any] = {}
        #: how the last version was read (``VersionReader``'s record: full or delta, seconds)
        self.last_record: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: StoreInitInfo) -> None:
        """No rendezvous: every update names its own version."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: StoreUpdateInfo) -> None:
        from astraflow.rollout.weight_sync import VersionReader

        key = (update_info.weights_root, update_info.use_deltas, update_info.full_resync_every)
        if key not in self._readers:
            self._readers[key] = VersionReader(*key)
        state, record = self._readers[key].read(update_info.policy, update_info.version)
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            # a tied head left out of the version (HF's save_pretrained, Megatron's converter): load
            # it explicitly, or a build that keeps a processed copy of the head serves the old one
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        self.model.load_weights(iter(state.items()))
        self.last_record = {k: v for k, v in record.items() if isinstance(v, (int, float, str, type(None)))}

    def shutdown(self) -> None:
        self._readers.clear()

    @staticmethod
    def trainer_send_weights(*args: Any, **kwargs: Any) -> None:
        """The trainer side of the transfer (abstract in some vLLM builds): trainers publish to
        the weight store, so nothing is sent through this backend."""
        raise NotImplementedError("astraflow_store: trainers publish versions to the weight store")


class WorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): vLLM imports this module in
    every worker, which registers the ``astraflow_store`` backend before the worker creates
    its weight-transfer engine; its method is reachable through ``collective_rpc``."""

    def astraflow_last_read(self) -> dict[str, Any]:
        """How this worker read the last version (full shards or a delta, seconds)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last_record", {}))


def register() -> None:
    """Register ``astraflow_store`` with vLLM's weight-transfer factory (once per process)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, StoreWeightTransferEngine)


register()
