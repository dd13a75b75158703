"""The probe a trainer publishes with each weight version, so that an engine can check its update.

An engine that loads new weights in place can get it wrong without an error (a kernel that
keeps a stale repacked copy, a shard loaded into the wrong slot). The cheap, end-to-end check
is to score a fixed token sequence: the trainer computes the teacher-forced log-probs of the
probe sequence with exactly the weights it publishes and stores them in the version's
manifest (``meta["probe"]``); after loading the version the engine scores the same tokens and
compares. A wrong update is off by nats, rounding noise by far less.

``meta["probe"]`` (written by the trainer backend at publish, read by rollout engines):

* ``tokens``: the probe sequence (token ids, a fixed pseudo-random sequence over the vocabulary);
* ``logprobs``: ``log p(tokens[i] | tokens[:i])`` for ``i >= 1``, fp32 from the published weights.

Both trainer backends publish it (the torch backend from its HF model, the Megatron backend with
a forward of its ranks). A version without ``probe`` (a backend that does not compute one, a
version published before the probe existed) cannot be checked this way; engines load it
unverified, with a warning.

Neutral ground like ``weightconv``: the trainer writes it, rollout reads it, neither imports the other.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

#: tokens in the probe sequence
PROBE_LEN = 32


def probe_tokens(vocab_size: int, n: int = PROBE_LEN, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token sequence over the vocabulary (the same for every version)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab_size, size=n)]


def teacher_forced_logprobs(model: Any, tokens: Sequence[int], state: Mapping[str, Any] | None = None) -> list[float]:
    """``log p(tokens[i] | tokens[:i])`` for ``i >= 1`` under an HF causal LM, fp32 logits;
    with ``state`` (HF names) the model's forward uses those tensors instead of its own
    parameters (cast to fp32 on the model's device), leaving the model untouched."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    with torch.no_grad():
        if state is None:
            logits = model(input_ids=ids).logits
        else:
            # one value per tied parameter (named_parameters lists one name of each)
            names = {k for k, _ in model.named_parameters()} | {k for k, _ in model.named_buffers()}
            params = {k: v.to(device, torch.float32) for k, v in state.items() if k in names and v.is_floating_point()}
            logits = torch.func.functional_call(model, params, args=(), kwargs={"input_ids": ids}, strict=False).logits
        logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
        return logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()


def make_probe(model: Any, state: Mapping[str, Any] | None = None) -> dict[str, list]:
    """``meta["probe"]`` for ``model`` (or for ``state`` run through its architecture), in eval
    mode (no dropout) whatever mode the model is in."""
    text = model.config.get_text_config()  # a multimodal model's language part holds both numbers
    positions = getattr(text, "max_position_embeddings", None)
    n = min(PROBE_LEN, positions) if isinstance(positions, int) else PROBE_LEN
    tokens = probe_tokens(int(text.vocab_size), n=n)
    training = model.training
    model.eval()
    try:
        return {"tokens": tokens, "logprobs": teacher_forced_logprobs(model, tokens, state)}
    finally:
        model.train(training)


def probe_error(expected: Sequence[float], got: Sequence[float]) -> float:
    """Mean absolute difference in nats between two probe log-prob lists of the same length;
    ``inf`` where either holds a NaN or an infinity (weights that produce them are wrong, and a
    NaN would otherwise compare below every tolerance)."""
    a, b = np.asarray(expected, dtype=np.float64), np.asarray(got, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"probe log-probs of different lengths: {a.shape} vs {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.inf
    return float(np.abs(a - b).mean())


def compute_in_fp32(model: Any) -> None:
    """Make ``model``'s forward compute what ``model.float()``'s would, holding it in its own dtype:
    floating buffers and parameters outside the decoder's layers (its largest ``ModuleList``) upcast
    at once, each layer's parameters upcast just before it runs and given back their loaded tensors
    after it, so the fp32 copy of one layer at a time is held, not the model's."""
    import torch

    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    prefix, layers = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()),
                         default=("", torch.nn.ModuleList()))
    # a parameter also reachable from outside the layers (shared with another part) is upcast at once
    elsewhere = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
                 if not name.startswith(prefix + ".")}
    per_layer = {id(p) for p in layers.parameters()} - elsewhere
    for m in model.modules():
        for name, b in m.named_buffers(recurse=False):
            setattr(m, name, b.float() if b.is_floating_point() else b)
    for p in model.parameters():
        if id(p) not in per_layer and p.is_floating_point():
            p.data = p.data.float()
    for layer in dict.fromkeys(layers):  # a block listed twice (shared across depth) is hooked once
        own = [p for p in layer.parameters() if id(p) in per_layer and p.is_floating_point()]
        kept: list[torch.Tensor] = []

        def up(_m, _args, own=own, kept=kept):
            kept[:] = [p.data for p in own]
            for p in own:
                p.data = p.data.float()

        def down(_m, _args, _out, own=own, kept=kept):  # the loaded tensors back, not a new cast of them
            for p, loaded in zip(own, kept):
                p.data = loaded
            kept.clear()

        layer.register_forward_pre_hook(up)
        layer.register_forward_hook(down)
