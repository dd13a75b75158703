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


def test_a_tokenizer_that_adds_a_bos_gets_none_inside_the_trained_answer():
    """A Llama-style tokenizer prepends BOS to whatever it encodes: the prompt keeps its BOS,
    the answer (under the loss) gets none."""
    from tokenizers import processors

    from astraflow.models import build_tokenizer
    from astraflow.training.warmstart import _encode_pairs

    tok = build_tokenizer()
    bos = "<|endoftext|>"
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    tok.bos_token = bos
    ids, _, loss = _encode_pairs(tok, [("12+34=", "46")])
    row, mask = ids[0].tolist(), loss[0].tolist()
    bos_id = tok.convert_tokens_to_ids(bos)
    assert row[0] == bos_id
    assert not [i for i, (t, m) in enumerate(zip(row, mask)) if t == bos_id and m]
