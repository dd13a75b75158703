"""Chat-templated prompts: the trained BPE tokenizer of built models, prompt rendering with a
chat template or as plain text, the tokens that end a turn, and the warm start on reference
solutions in exactly the rollout token layout."""

import json

import pytest

from astraflow.agents.chat import end_of_turn_ids, prompt_ids
from astraflow.models import build_bpe_tokenizer, build_tokenizer, init_model, load_model
from astraflow.workloads.base import make_workload

CORPUS = [f"{n} has {a} apples and gets {b} more. How many apples?\n{a} + {b} = {a + b}\n#### {a + b}"
          for n in ("Tom", "Sara", "Ali") for a in range(3, 40, 3) for b in range(2, 30, 4)]


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(CORPUS, vocab_size=400)


def test_bpe_tokenizer_merges_round_trips_and_splits_digits(bpe):
    assert 262 < len(bpe) <= 400 and bpe.chat_template
    text = CORPUS[5]
    ids = bpe.encode(text, add_special_tokens=False)
    assert len(ids) < len(text.encode()) / 2  # real merges: far fewer tokens than bytes
    for s in (text, "héllo wörld ∑ 🙂 1234567", "<tool_call>{\"a\": 1}</tool_call>"):
        assert bpe.decode(bpe.encode(s, add_special_tokens=False)) == s
    digits = [t for t in bpe.convert_ids_to_tokens(bpe.encode("12345 + 678", add_special_tokens=False)) if any(c.isdigit() for c in t)]
    assert all(sum(c.isdigit() for c in t) == 1 for t in digits)  # one digit per token
    with pytest.raises(ValueError, match="at least"):
        build_bpe_tokenizer(CORPUS, vocab_size=100)


def _workload(tmp_path):
    rows = [{"question": c.split("\n")[0], "answer": "\n".join(c.split("\n")[1:])} for c in CORPUS]
    path = tmp_path / "wp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return make_workload("dataset", {"path": str(path), "preset": "gsm8k", "reward": "numeric",
                                     "system_prompt": "Solve it."}, seed=0)


def test_prompt_is_rendered_with_the_chat_template_or_as_plain_text(tmp_path, bpe):
    wl = _workload(tmp_path)
    p = wl.tasks("train")[0]
    ids = prompt_ids(bpe, wl, p)
    text = bpe.decode(ids)
    assert text == (f"<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n{p['messages'][-1]['content']}"
                    "<|im_end|>\n<|im_start|>assistant\n")
    plain = build_tokenizer()
    plain.chat_template = None  # a base model without a template
    assert plain.decode(prompt_ids(plain, wl, p)) == f"Solve it.\n{p['messages'][-1]['content']}\n"


def test_end_of_turn_is_the_templates_closing_token_even_when_it_is_not_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from astraflow.rollout.hf_engine import HFEngine

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.add_special_tokens(["<|end_of_text|>", "<|eot|>", "<|pad|>"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|end_of_text|>", pad_token="<|pad|>",  # Llama-3 style: eos is not the turn end
        chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|eot|>{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")
    eot = tok.convert_tokens_to_ids("<|eot|>")
    assert end_of_turn_ids(tok) == [tok.eos_token_id, eot]
    assert end_of_turn_ids(build_tokenizer()) == [build_tokenizer().eos_token_id]
    d = init_model(tmp_path / "m", preset="tiny", tokenizer=tok)
    engine = HFEngine(str(d), max_batch_size=2)
    assert eot in engine._stop_ids and tok.eos_token_id in engine._stop_ids


def test_warm_start_on_reference_solutions_learns_in_the_rollout_layout(tmp_path, bpe):
    from astraflow.training.demo_warmstart import collate, demo_warm_start, encode_examples

    wl = _workload(tmp_path)
    p = wl.tasks("train")[0]
    (prompt, target), = encode_examples(bpe, wl, [p])
    assert prompt == prompt_ids(bpe, wl, p)  # exactly what a rollout sends
    assert bpe.decode(target) == p["solution"] + "<|im_end|>"
    ids, att, lm = collate([(prompt, target), (prompt[:3], target)], bpe.pad_token_id)
    assert lm[0].sum() == len(target) and not lm[0, : len(prompt)].any()
    assert att[1].sum() == 3 + len(target)
    d = init_model(tmp_path / "m", preset="tiny", tokenizer=bpe)
    out = demo_warm_start(d, tmp_path / "w", wl, max_new_tokens=16, steps=30, lr=3e-3, eval_every=0,
                          eval_size=8, progress=False)
    assert out["steps"] == 30 and out["history"][-1]["loss"] < 3.0  # from ln(vocab) ~ 6 at random init
    model, tok = load_model(tmp_path / "w")
    assert len(tok) == len(bpe) and 0.0 <= out["acc"] <= 1.0


def test_a_mixture_renders_each_source_its_own_way(tmp_path, bpe):
    wl_path = tmp_path / "wp.jsonl"
    wl_path.write_text("".join(json.dumps({"question": c.split("\n")[0], "answer": "\n".join(c.split("\n")[1:])}) + "\n"
                               for c in CORPUS))
    mix = make_workload("mix", {"sources": {
        "words": {"workload": "dataset", "weight": 1, "params": {"path": str(wl_path), "preset": "gsm8k", "reward": "numeric"}},
        "sums": {"workload": "math", "weight": 1, "params": {"digits": 1, "num_test": 5}}}}, seed=0)
    by_source = {p["source"]: p for p in mix.tasks("eval")}
    assert bpe.decode(prompt_ids(bpe, mix, by_source["words"])).startswith("<|im_start|>user\n")
    assert bpe.decode(prompt_ids(bpe, mix, by_source["sums"])) == f"{by_source['sums']['question']}="


def test_an_eos_that_is_also_the_unk_token_still_stops_a_turn(tiny_model, tmp_path):
    """GPT-2, Phi, NeoX tokenizers: unk = bos = eos = <|endoftext|>. Only a guess that encodes as
    unk (a closing the vocabulary lacks) is no stop; the tokenizer's and the model's eos are."""
    import shutil

    from astraflow.agents.chat import turn_stop_ids
    from astraflow.rollout.hf_engine import HFEngine

    model = tmp_path / "eos-is-unk"
    shutil.copytree(tiny_model, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    tok = load_model(tiny_model)[1]
    cfg["unk_token"] = tok.eos_token  # the eos doubles as unk
    cfg_path.write_text(json.dumps(cfg))
    engine = HFEngine(model, device="cpu")
    eos = engine.tokenizer.eos_token_id
    assert engine.tokenizer.unk_token_id == eos and eos in turn_stop_ids(engine.tokenizer)
    assert eos in engine._stop_ids  # (it was filtered out with the unk: every completion ran to its budget)


def test_a_template_that_skips_the_system_role_keeps_the_system_prompt(tmp_path):
    """A template that renders user and assistant messages only (Phi-3's first) would drop
    ``system_prompt`` without an error: it goes at the head of the user message instead."""
    wl = _workload(tmp_path)
    p = wl.tasks("train")[0]
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert tok.decode(prompt_ids(tok, wl, p)) == (f"<|im_start|>user\nSolve it.\n\n{p['messages'][-1]['content']}"
                                                  "<|im_end|>\n<|im_start|>assistant\n")
