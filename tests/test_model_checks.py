"""Model directories that look complete but cannot run are refused before a run starts: no
tokenizer files (transformers would build an empty tokenizer), unreadable or missing weight files,
weights that lack tensors (they would train from random values), and a warm start from a tokenizer
with no eos. Each message names the directory or file and the fix; ``astraflow check`` exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from astraflow.models import check_model_dir, init_model, load_model, load_tokenizer
from tests.test_hf_models import _broken, _check, _edit_json

TOKENIZER_FIX = "copy the tokenizer files of the checkpoint into it"
WEIGHTS_FIX = "copy the checkpoint's weight files into it again (every shard)"


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "untied", preset="tiny", arch="qwen2", seed=1,
                      tie_word_embeddings=False)


def _refused_everywhere(tmp_path: Path, bad: Path, needle: str, fix: str, loads=(check_model_dir, load_model)):
    """``needle`` and ``fix`` in the error of every loader and of ``astraflow check`` (exit 2)."""
    for load in loads:
        with pytest.raises(ValueError) as err:
            load(bad)
        assert needle in str(err.value) and fix in str(err.value), str(err.value)
    res = _check(tmp_path, bad)
    assert res.exit_code == 2, res.output
    assert "policies[solver].model: " in res.output and needle in res.output, res.output
    assert "Traceback" not in res.output


def test_a_directory_without_tokenizer_files(tiny_model, tmp_path):
    bad = _broken(tiny_model, tmp_path, "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bad / name).unlink()
    _refused_everywhere(tmp_path, bad, f"{bad} has no tokenizer files (none of tokenizer.json", TOKENIZER_FIX,
                        loads=(check_model_dir, load_model, load_tokenizer))


def test_a_tokenizer_that_encodes_nothing(tiny_model, tmp_path):
    """Tokenizer files with an empty vocabulary load, but encode every text to no tokens."""
    bad = _broken(tiny_model, tmp_path, "m")
    (bad / "tokenizer.json").unlink()
    (bad / "vocab.json").write_text("{}")
    (bad / "merges.txt").write_text("#version: 0.2\n")
    _edit_json(bad / "tokenizer_config.json", tokenizer_class="Qwen2Tokenizer")
    _refused_everywhere(tmp_path, bad, f"the tokenizer of {bad} encodes text to no tokens", TOKENIZER_FIX,
                        loads=(check_model_dir, load_model, load_tokenizer))



def test_a_tokenizer_with_more_tokens_than_the_models_vocabulary(tiny_model, tmp_path):
    """Ids past vocab_size have no embedding: every rollout that meets one would fail."""
    n = len(load_tokenizer(tiny_model))  # added tokens included
    bad = _broken(tiny_model, tmp_path, "m")
    _edit_json(bad / "config.json", vocab_size=n - 10)
    _refused_everywhere(tmp_path, bad, f"the tokenizer of {bad} has {n} tokens, more than the model's vocabulary of "
                        f"{n - 10}", "put the model's own tokenizer files next to it",
                        loads=(check_model_dir, load_model, load_tokenizer))
    nested = _broken(tiny_model, tmp_path, "nested")  # a multimodal config keeps it in text_config
    config = json.loads((nested / "config.json").read_text())
    (nested / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k != "vocab_size"},
                                                    "text_config": {"vocab_size": n - 10}}))
    with pytest.raises(ValueError, match=f"has {n} tokens, more than the model's vocabulary of {n - 10}"):
        load_tokenizer(nested)
    assert config["vocab_size"] > n  # a smaller tokenizer is normal: the embeddings are padded
    check_model_dir(tiny_model)


def test_added_tokens_past_the_vocabulary_are_refused_only_where_runs_write_them(tiny_model, tmp_path):
    """A real checkpoint may list added tokens past vocab_size that no text prompt, template or
    stop token uses (an image token): accepted. Its eos past vocab_size is not."""
    tok = load_tokenizer(tiny_model)
    written = {tok.eos_token_id, tok.pad_token_id, *tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], tokenize=True)}
    unused = len(tok) - 1
    assert unused not in written and tok.vocab_size < unused  # the last added token: no run writes it
    spare = _broken(tiny_model, tmp_path, "spare")
    _edit_json(spare / "config.json", vocab_size=unused)  # (only the tokenizer's check: the weights' shapes differ)
    load_tokenizer(spare)
    eos = _broken(tiny_model, tmp_path, "eos")
    _edit_json(eos / "config.json", vocab_size=tok.eos_token_id)
    with pytest.raises(ValueError, match=rf"the tokens \[.*{tok.eos_token_id}.*\] that runs write have no embedding"):
        load_tokenizer(eos)


def _bert(out: Path, tokenizer_from: Path) -> Path:
    """A BERT encoder saved as BertModel (no LM head), with a tokenizer."""
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer_from / name).read_bytes())
    return out


def test_a_checkpoint_that_is_not_a_causal_lm_class_is_refused(tiny_model, tmp_path):
    """transformers maps model_type bert to BertLMHeadModel, but a BertModel checkpoint has no LM head."""
    bert = _bert(tmp_path / "bert", tiny_model)
    _refused_everywhere(tmp_path, bert, f"{bert}: config.json's architectures BertModel is not a causal language "
                        "model class", "AstraFlow needs a causal (decoder) language model")
    base = _broken(tiny_model, tmp_path, "base")  # a causal model_type, saved without its head
    _edit_json(base / "config.json", architectures=["Qwen2Model"])
    with pytest.raises(ValueError, match="architectures Qwen2Model is not a causal language model class"):
        check_model_dir(base)
    for archs in (None, [], ["Qwen2ForCausalLM"], ["Gemma3ForConditionalGeneration"], ["GPT2LMHeadModel"],
                  ["Qwen2Model", "Qwen2ForCausalLM"]):  # no architectures, or one a causal LM
        _edit_json(base / "config.json", architectures=archs)
        check_model_dir(base)
    llama = init_model(tmp_path / "llama", preset="tiny", arch="llama", tie_word_embeddings=False)
    check_model_dir(llama)  # what astraflow builds itself


@pytest.mark.parametrize("cut", ["empty", "truncated"])
def test_an_empty_or_truncated_safetensors_file(tiny_model, tmp_path, cut):
    bad = _broken(tiny_model, tmp_path, "m")
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"" if cut == "empty" else data[: len(data) // 2])
    needle = f"{weights} is empty" if cut == "empty" else f"{weights} cannot be read as safetensors"
    _refused_everywhere(tmp_path, bad, needle, WEIGHTS_FIX)


def _sharded(tiny_model: Path, tmp_path: Path) -> Path:
    model, _ = load_model(tiny_model)
    out = _broken(tiny_model, tmp_path, "sharded")
    (out / "model.safetensors").unlink()
    model.save_pretrained(out, max_shard_size="1MB")
    return out


def test_a_sharded_checkpoint_loads_and_one_with_a_missing_shard_is_refused(tiny_model, tmp_path):
    sharded = _sharded(tiny_model, tmp_path)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    check_model_dir(sharded)
    load_model(sharded)
    shards[-1].unlink()
    _refused_everywhere(tmp_path, sharded, f"names weight shards that are missing from {sharded} ({shards[-1].name})",
                        WEIGHTS_FIX)


def _drop_tensors(d: Path, prefix: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(d / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith(prefix)}, d / "model.safetensors",
              metadata={"format": "pt"})


def test_weights_that_lack_tensors_are_refused(untied, tiny_model, tmp_path):
    bad = _broken(untied, tmp_path, "m")
    _drop_tensors(bad, "model.layers.3.")
    _refused_everywhere(tmp_path, bad, f"{bad}: the weight files lack 12 tensor(s) the model needs", WEIGHTS_FIX)
    head = _broken(untied, tmp_path, "head")
    _drop_tensors(head, "lm_head.")
    with pytest.raises(ValueError, match=r"lack 1 tensor\(s\) the model needs \(lm_head.weight\).*tie_word_embeddings"):
        check_model_dir(head)
    check_model_dir(tiny_model)  # a tied head is not in the file, and not missing


def test_a_config_that_does_not_describe_its_weights_is_refused(tiny_model, tmp_path):
    """Weights of other shapes than config.json gives (a config of another model copied next to
    them) would fail only once a run's workers load them."""
    config = json.loads((tiny_model / "config.json").read_text())
    bad = _broken(tiny_model, tmp_path, "wide")
    _edit_json(bad / "config.json", intermediate_size=2 * config["intermediate_size"])
    _refused_everywhere(tmp_path, bad, f"{bad}: config.json does not describe the weights next to it",
                        "put the checkpoint's own config.json next to its weights")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight: \[\d+, \d+\] in the weight files"):
        check_model_dir(bad)
    packed = _broken(bad, tmp_path, "packed")  # a pre-quantized checkpoint stores packed shapes: not compared
    _edit_json(packed / "config.json", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    check_model_dir(packed)


def test_a_config_transformers_cannot_load_is_blamed_not_the_tokenizer(tiny_model, tmp_path):
    bad = _broken(tiny_model, tmp_path, "layers")
    config = json.loads((bad / "config.json").read_text())
    _edit_json(bad / "config.json", num_hidden_layers=config["num_hidden_layers"] + 2,
               layer_types=["full_attention"] * config["num_hidden_layers"])
    with pytest.raises(ValueError) as err:
        check_model_dir(bad)
    said = str(err.value)
    assert said.startswith(f"{bad}/config.json cannot be loaded by transformers") and "tokenizer" not in said, said


def test_a_pytorch_bin_checkpoint_is_checked_as_safetensors_are(untied, tmp_path):
    """Names and shapes are read from pytorch_model.bin on the meta device: missing tensors are
    refused by the check (before any worker), as load_model's own report refuses them."""
    model, _ = load_model(untied)
    whole = _broken(untied, tmp_path, "whole")
    (whole / "model.safetensors").unlink()
    torch.save(model.state_dict(), whole / "pytorch_model.bin")
    check_model_dir(whole)
    bad = _broken(whole, tmp_path, "m")
    torch.save({k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.3.")},
               bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"the weight files lack 12 tensor\(s\) the model needs"):
        check_model_dir(bad)
    with pytest.raises(ValueError, match=r"the weight files lack 12 tensor\(s\) the model needs .*every shard"):
        load_model(bad)
    (bad / "pytorch_model.bin").write_bytes(b"not a torch file at all")
    with pytest.raises(ValueError, match="cannot be read as PyTorch weights"):
        check_model_dir(bad)


def test_a_warm_start_pads_with_eos_when_the_tokenizer_has_no_pad_token(tiny_model, tmp_path):
    from astraflow.training.warmstart import _encode_pairs, warm_start

    nopad = _broken(tiny_model, tmp_path, "nopad")
    _edit_json(nopad / "tokenizer_config.json", pad_token=None)
    tok = load_tokenizer(nopad)
    assert tok.pad_token_id is None
    ids, att, _ = _encode_pairs(tok, [("1+2=", "3"), ("10+20=", "30")])
    assert ids[0, -1].item() == tok.eos_token_id and att[0, -1].item() == 0
    out = warm_start(nopad, tmp_path / "out", steps=1, batch_size=4, eval_every=0, eval_size=4, progress=False,
                     workload={"digits": 1, "num_test": 8}, task="verify")
    assert out["steps"] == 1 and (tmp_path / "out" / "model.safetensors").is_file()


def test_a_warm_start_from_a_tokenizer_without_eos_is_refused_up_front(tiny_model, tmp_path):
    from astraflow.cli import main
    from astraflow.training.warmstart import warm_start

    noeos = _broken(tiny_model, tmp_path, "noeos")
    _edit_json(noeos / "tokenizer_config.json", eos_token=None)
    with pytest.raises(ValueError, match=f"the tokenizer of {noeos} has no eos token.*set eos_token in its "
                                         "tokenizer_config.json"):
        warm_start(noeos, tmp_path / "out", steps=1, progress=False)
    assert not (tmp_path / "out").exists()
    cfg = {"run": {"name": "noeos", "max_steps": 1},
           "policies": [{"name": "solver", "model": str(noeos)},
                        {"name": "verifier", "model": str(tmp_path / "verifier"),
                         "init": {"start_from": "solver", "task": "verify", "warm_start_steps": 2}}],
           "workload": {"name": "math", "workflow": "solver_verifier", "params": {"digits": 1, "num_test": 20},
                        "group_size": 4, "sampling": {"max_new_tokens": 4}},
           "dataflow": {"batch_size": 16}, "cluster": {"dashboard_port": 0}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(main, ["check", str(tmp_path / "config.yaml")])
    assert res.exit_code == 2, res.output
    assert f"policies[verifier].init.start_from: solver: the tokenizer of {noeos} has no eos token" in res.output
    assert "set eos_token" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "verifier").exists()
    cfg["policies"][1]["init"] = {"start_from": "solver"}  # no warm start: no eos needed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert CliRunner().invoke(main, ["check", str(tmp_path / "config.yaml")]).exit_code == 0


def test_a_generation_longer_than_the_models_positions_is_refused(tiny_model, tmp_path):
    from astraflow.cli import main

    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init", None)
    data["workload"]["sampling"] = {"max_new_tokens": 4096}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["check", str(tmp_path / "config.yaml")])
    assert res.exit_code == 2 and "workload.sampling.max_new_tokens 4096: the model of policy" in res.output
    assert "has 2048 positions" in res.output, res.output



def test_a_generation_longer_than_the_positions_of_a_model_init_builds_is_refused(tmp_path):
    from astraflow.cli import main

    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "m")  # to be built by init (preset tiny)
    data["workload"]["sampling"] = {"max_new_tokens": 3000}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["check", str(tmp_path / "config.yaml")])
    assert res.exit_code == 2 and "workload.sampling.max_new_tokens 3000: the model of policy solver" in res.output
    assert f"({tmp_path / 'm'}, to be built by init) has 2048 positions" in res.output, res.output
    assert not (tmp_path / "m").exists()
    data["workload"]["sampling"] = {"max_new_tokens": 2000}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    assert CliRunner().invoke(main, ["check", str(tmp_path / "config.yaml")]).exit_code == 0


@pytest.mark.parametrize("text", ['{"eos_token_id": [1, 2', "[1, 2]"])
def test_a_damaged_generation_config_is_refused_naming_the_file(tiny_model, tmp_path, text):
    """Its end tokens would be lost without a word in a run, and vLLM and export fail on it."""
    bad = _broken(tiny_model, tmp_path, "gen")
    (bad / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=r"generation_config.json is .*restore the checkpoint's own file, or "
                                         "remove it"):
        check_model_dir(bad)
