import pytest

from astraflow.models import load_model
from astraflow.training.warmstart import evaluate, warm_start
from astraflow.workloads.math import make_dataset


def test_warm_start_learns_one_digit_addition(tiny_model, tmp_path):
    wl = {"digits": 1, "num_test": 10, "test_fraction": 0.1}
    before = evaluate(*load_model(tiny_model), make_dataset(wl, "test"))
    res = warm_start(tiny_model, tmp_path / "ws", steps=150, lr=3e-3, batch_size=32, workload=wl,
                     eval_every=0, progress=False)
    assert res["steps"] == 150
    model, tok = load_model(tmp_path / "ws")
    after = evaluate(model, tok, make_dataset(wl, "test"))
    assert after == res["acc"]
    assert after >= 0.5 > before


def test_warm_start_stops_at_target(tiny_model, tmp_path):
    wl = {"digits": 1, "num_test": 10}
    res = warm_start(tiny_model, tmp_path / "ws", steps=300, lr=3e-3, batch_size=32, workload=wl,
                     target_acc=0.2, eval_every=20, progress=False)
    assert res["acc"] >= 0.2 and res["steps"] < 300
    assert res["history"][-1]["acc"] == res["acc"]
    assert [h["step"] for h in res["history"]] == list(range(20, res["steps"] + 1, 20))


def test_warm_start_needs_a_stop(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="stopping rule"):
        warm_start(tiny_model, tmp_path / "x")
