import pytest

from astraflow.models import load_model
from astraflow.training.warmstart import evaluate, warm_start
from astraflow.workloads.math import make_dataset


def test_warm_start_learns_one_digit_addition(tiny_model, tmp_path):
    """Learning is judged on the training problems: the held-out ones are too few to tell a warm
    start that learned from one that a CPU rounding otherwise landed a few problems lower."""
    wl = {"digits": 1, "num_test": 10, "test_fraction": 0.1}
    before = evaluate(*load_model(tiny_model), make_dataset(wl, "train"))
    res = warm_start(tiny_model, tmp_path / "ws", steps=150, lr=3e-3, batch_size=32, workload=wl,
                     eval_every=0, progress=False)
    assert res["steps"] == 150
    model, tok = load_model(tmp_path / "ws")
    assert evaluate(model, tok, make_dataset(wl, "test")) == res["acc"]  # what it reports: the held-out ones
    assert evaluate(model, tok, make_dataset(wl, "train")) >= 0.5 > before


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


def test_a_loop_that_ends_on_a_worse_evaluation_keeps_the_best_weights(tiny_model, tmp_path):
    """The model saved is the one of the best evaluation, not the last, when the bound ends the
    loop after a worse one (a bounded warm start that dipped at its end)."""
    import torch

    from astraflow.training.warmstart import supervised_loop

    model, tok = load_model(tiny_model)
    saved: dict[int, dict] = {}
    scores = iter([0.1, 0.6, 0.2])  # evaluations at steps 1, 2 and 3 (the end)

    def evaluate_() -> float:
        step = len(saved) + 1
        saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return next(scores)

    ids = torch.tensor([tok.encode("1+2=3")] * 4)
    batch = (ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    res = supervised_loop(model, tok, tmp_path / "out", lambda: batch, evaluate_, label="t", steps=3, seconds=None,
                          lr=1e-2, target_acc=None, eval_every=1, warmup_steps=1, progress=False, on_eval=None)
    assert (res["steps"], res["acc"], res["kept_step"]) == (3, 0.6, 2)
    kept, _ = load_model(tmp_path / "out")
    for name, value in kept.state_dict().items():
        assert torch.equal(value, saved[2][name]), name
    assert not torch.equal(saved[3]["model.embed_tokens.weight"], saved[2]["model.embed_tokens.weight"])
