"""The Megatron ranks' optimiser-state record (``training/megatron/state.py``) on a plain module:
keyed by parameter name, it survives ``torch.save`` / ``torch.load(weights_only=True)`` and
continues with the same step; a record saved under another tensor-parallel size is cut again for
this one; a record of another pipeline layout or model is refused by name. Pure torch (no Megatron
import, no process): what each rank runs on its own shard."""

from __future__ import annotations

import io

import pytest
import torch

from astraflow.training.megatron.convert import shard_for_rank
from astraflow.training.megatron.state import (
    check_optimizer_state, for_tensor_parallel, layout, load_named_optimizer_state, named_optimizer_state, pack, unpack,
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
    other_pipeline = {**saved, "layout": {**saved["layout"], "pipeline_parallel": 2}}
    with pytest.raises(ValueError, match="saved with the parallel layout .*pipeline_parallel=2 and this trainer runs"):
        check_optimizer_state(other_pipeline, [shapes])
    with pytest.raises(ValueError, match="saved with the parallel layout .*pipeline_parallel=2 and this trainer runs"):
        for_tensor_parallel(other_pipeline, 2)
    with pytest.raises(ValueError, match="not an optimiser state of the Megatron backend"):
        check_optimizer_state(opt_a.state_dict(), [shapes])
    with pytest.raises(ValueError, match=r"0.weight exp_avg has shape \(3, 4\), the parameter \(3, 5\)"):
        check_optimizer_state(saved, [{**shapes, "0.weight": [3, 5]}])
    with pytest.raises(ValueError, match="names parameters this model does not have"):
        check_optimizer_state(saved, [{k: v for k, v in shapes.items() if k != "1.weight"}])


#: Megatron parameter names of each kind of cut (``convert``): rows, [gate; up] rows, columns, replicated
_FULL_SHAPES = {"embedding.word_embeddings.weight": (8, 3), "decoder.layers.0.mlp.linear_fc1.weight": (8, 3),
                "decoder.layers.0.self_attention.linear_proj.weight": (3, 4), "decoder.final_layernorm.weight": (3,)}


def _state_for(full: dict, tp: int, step: float = 7.0) -> dict:
    """The record ``tp`` ranks save for the full moments ``full`` (``exp_avg``; ``exp_avg_sq`` its square)."""
    ranks = []
    for t in range(tp):
        cut = shard_for_rank(full, t, tp)
        ranks.append({"state": {n: {"step": torch.tensor(step), "exp_avg": cut[n], "exp_avg_sq": cut[n] ** 2}
                                for n in full},
                      "param_groups": [{"lr": 1e-3, "params": list(full)}]})
    return {"backend": "megatron", "layout": layout(tp, 2), "ranks": ranks}


def test_a_state_saved_under_another_tensor_parallel_size_is_cut_again():
    torch.manual_seed(0)
    full = {n: torch.randn(shape) for n, shape in _FULL_SHAPES.items()}
    saved = _state_for(full, 2)
    for tp in (1, 2, 4):
        got = for_tensor_parallel(saved, tp)
        want = _state_for(full, tp)
        assert got["layout"] == layout(tp, 2) and len(got["ranks"]) == tp
        check_optimizer_state(got, [{n: list(m["exp_avg"].shape) for n, m in rec["state"].items()}
                                    for rec in want["ranks"]], dp_size=1)
        for g, w in zip(got["ranks"], want["ranks"]):
            assert g["param_groups"] == w["param_groups"]
            for n in full:
                assert float(g["state"][n]["step"]) == 7.0
                assert all(torch.equal(g["state"][n][k], w["state"][n][k]) for k in ("exp_avg", "exp_avg_sq")), n
    assert for_tensor_parallel(saved, 2) is saved
    damaged = _state_for(full, 2)
    del damaged["ranks"][1]["state"]["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError, match="ranks hold moments of different parameters: it is damaged"):
        for_tensor_parallel(damaged, 1)


def test_packed_views_carry_only_their_own_elements():
    full = torch.arange(100_000, dtype=torch.float32)
    half = full[:10]
    data = pack({"t": half})
    assert len(data) < len(pack({"t": full})) / 10
    assert torch.equal(unpack(data)["t"], half)
