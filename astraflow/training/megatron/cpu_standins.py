"""CPU stand-ins that let Megatron-core's GPTModel run (forward, backward, checkpointing) on CPU.

Megatron-core assumes a CUDA device in a few places that matter for us even with
``use_cpu_initialization=True`` and a gloo process group: it asks ``torch.cuda.current_device()``
for the device of a few buffers (rotary inv_freq, logits helpers), calls
``torch.cuda.synchronize()`` around checkpoint I/O, and seeds a CUDA RNG tracker. On a machine
without CUDA (CI, laptops, the embedded default) we replace exactly these three things, which
suffice for the pinned megatron-core (``pyproject.toml``; the parity tests check it), and nothing
else.

The patch is applied only when ``not torch.cuda.is_available()``; on a GPU node it is a no-op and
Megatron runs unmodified. It is idempotent and process-wide (it patches the ``torch.cuda``
module), so call it once at the start of a rank process, before building the model.
"""

from __future__ import annotations

import torch

_APPLIED = False


def apply_cpu_standins() -> bool:
    """Patch ``torch.cuda.current_device`` / ``torch.cuda.synchronize`` on CPU-only hosts.

    Returns True when the stand-ins are active (now or from an earlier call), False on a CUDA host.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if not _APPLIED:
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        _APPLIED = True
    return True


def seed_model_parallel_rng(seed: int) -> None:
    """Seed Megatron's tensor-parallel RNG tracker.

    On CUDA this is Megatron's normal ``model_parallel_cuda_manual_seed``. On CPU the CUDA RNG
    tracker cannot be used; Megatron's inference tracker (a no-op fork) stands in, which is
    correct as long as dropout is 0 (our configs always set it to 0).
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if apply_cpu_standins():
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=True, force_reset_rng=True
        )
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
