"""The Megatron ranks' optimiser-state record (``training/megatron/state.py``) on a plain module:
keyed by parameter name, it survives ``torch.save`` / ``torch.load(weights_only=True)`` and
continues with the same step; a record of another layout or model is refused by name. Pure torch
(no Megatron import, no process): what each rank runs on its own shard."""

from __future__ import annotations

import io

import pytest
import torch

from astraflow.training.megatron.state import (
    check_optimizer_state, layout, load_named_optimizer_state, named_optimizer_state, pack, unpack,
)

pytestmark = pytest.mark.timeout(60)


def _model_and_opt(lr: float = 1e-2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _step(model, opt, seed: int) -> None:
    torch.manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()


def _record(model, opt) -> dict:
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    state = {"backend": "megatron", "layout": layout(1), "ranks": [named_optimizer_state(model, opt)]}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True), shapes


def test_a_saved_state_continues_with_the_same_step():
    a, opt_a = _model_and_opt()
    for s in (1, 2):
        _step(a, opt_a, s)
    saved, shapes = _record(a, opt_a)
    assert set(saved["ranks"][0]["state"]) == {"0.weight", "0.bias", "1.weight"}
    b, opt_b = _model_and_opt(lr=5e-3)  # a resumed run may change lr: the moments come, lr stays
    b.load_state_dict(a.state_dict())
    check_optimizer_state(saved, [shapes])
    load_named_optimizer_state(b, opt_b, saved["ranks"][0])
    assert opt_b.param_groups[0]["lr"] == 5e-3
    opt_b.param_groups[0]["lr"] = 1e-2
    _step(a, opt_a, 3)
    _step(b, opt_b, 3)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


def test_another_layout_or_model_is_refused_by_name():
    a, opt_a = _model_and_opt()
    _step(a, opt_a, 1)
    saved, shapes = _record(a, opt_a)
    with pytest.raises(ValueError, match="saved with the parallel layout tensor_parallel=1.*runs tensor_parallel=2"):
        check_optimizer_state(saved, [shapes, shapes])
    with pytest.raises(ValueError, match="not an optimiser state of the Megatron backend"):
        check_optimizer_state(opt_a.state_dict(), [shapes])
    with pytest.raises(ValueError, match=r"0.weight exp_avg has shape \(3, 4\), the parameter \(3, 5\)"):
        check_optimizer_state(saved, [{**shapes, "0.weight": [3, 5]}])
    with pytest.raises(ValueError, match="names parameters this model does not have"):
        check_optimizer_state(saved, [{k: v for k, v in shapes.items() if k != "1.weight"}])


def test_packed_views_carry_only_their_own_elements():
    full = torch.arange(100_000, dtype=torch.float32)
    half = full[:10]
    data = pack({"t": half})
    assert len(data) < len(pack({"t": full})) / 10
    assert torch.equal(unpack(data)["t"], half)
