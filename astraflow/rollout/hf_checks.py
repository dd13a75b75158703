"""What the HF engine (``hf_engine``) checks of a model: at start, that its cached decoding step
gives the model's own distribution; per cache, whether rows can be copied between its rows."""

from __future__ import annotations

from typing import Any

import torch

#: nats, largest over the vocabulary: a cached decoding step and the full forward of the same tokens
#: agree this closely in fp32 (the order of sums differs; TF32 kernels on a GPU), in bf16/fp16 with
#: rounding; an architecture whose step reads its inputs wrongly is off by far more
CACHED_STEP_TOLERANCE = 0.05
ROUNDED_STEP_TOLERANCE = 0.5


#: what a user whose architecture the HF engine cannot decode can do instead
_NOT_SERVED = ("this architecture cannot be served by the HF engine: serve it with rollout.engine.type: vllm where "
               "vLLM supports it, or train a model of an architecture the HF engine decodes (a key/value cache, "
               "as Llama, Qwen2, Mistral, Gemma or GPT-2 have, or a state-space model such as Mamba)")


@torch.no_grad()
def check_cached_decoding(engine: Any, both_masks: bool) -> None:
    """The engine samples each token from a cached decoding step. Check at start, on a
    left-padded pair of rows, that such a step gives the model's own full-forward
    distribution: an architecture whose cached step differs would roll out from a wrong
    distribution without an error. A step that needs its new tokens' mask alone is switched
    to it (``both_masks``: both are tried); one that still differs, returns no cache or fails
    in the model's dtype is refused."""
    from astraflow.probe import probe_tokens

    dev, n = engine.device, 6
    padded = [engine._pad_id] * 2 + probe_tokens(engine._vocab, n - 2, seed=2)
    ids = torch.tensor([probe_tokens(engine._vocab, n, seed=1), padded], device=dev)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kind = getattr(engine.model.config, "model_type", type(engine.model).__name__)
    fp32 = next(engine.model.parameters()).dtype == torch.float32
    tolerance, bf16 = CACHED_STEP_TOLERANCE if fp32 else ROUNDED_STEP_TOLERANCE, not fp32
    try:
        full, _ = engine._forward(ids, mask, None)
        gaps = []
        for step_mask_only in (False, True) if both_masks else (engine._step_mask_only,):
            engine._step_mask_only = step_mask_only
            _, cache = engine._forward(ids[:, :-1], mask[:, :-1], None)
            step, _ = engine._forward(ids[:, -1:], mask, cache)
            gaps.append(float((torch.log_softmax(full, -1) - torch.log_softmax(step, -1)).abs().max()))
            if gaps[-1] <= tolerance:
                return
    except Exception as err:  # whatever the model raises: named with the architecture and the fix
        fix = "set rollout.engine.dtype: fp32" if bf16 else _NOT_SERVED
        raise ValueError(f"the HF engine cannot decode {kind} models{' in bf16' if bf16 else ''} "
                         f"({type(err).__name__}: {err}); {fix}") from err
    raise ValueError(f"the HF engine's cached decoding of {kind} models differs from their full forward by "
                     f"{min(gaps):.3g} nats (tolerance {tolerance}): rollouts would be sampled from a wrong "
                     f"distribution; {_NOT_SERVED}")


def row_indexable(cache: Any) -> bool:
    """Whether ``cache`` is transformers' plain per-layer key/value cache, whose rows can be
    selected and repeated (``batch_select_indices``) without other state to keep in step."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:  # a transformers without per-layer caches
        return False
    layers = getattr(cache, "layers", None)
    return (type(cache) is DynamicCache and bool(layers)
            and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers))
