"""Any HF causal-LM directory for the PyTorch trainer and the HF engine: a Qwen2 model with q/k/v
biases and a separate output head trains, serves and round-trips through the weight store; a
directory that cannot be used fails with one message naming the directory and the fix, from
``load_model``, from the trainer and the engines, and from ``astraflow check`` (exit code 2)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from astraflow.models import check_model_dir, init_model, load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "untied", preset="tiny", arch="qwen2", seed=1,
                      tie_word_embeddings=False)


def _broken(tiny_model: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(tiny_model, out)
    return out


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_the_untied_qwen2_model_has_biases_and_its_own_head(untied):
    model, _ = load_model(untied)
    assert model.config.tie_word_embeddings is False
    attn = model.model.layers[0].self_attn
    assert all(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    assert attn.o_proj.bias is None
    head, emb = model.lm_head.weight, model.model.embed_tokens.weight
    assert head.data_ptr() != emb.data_ptr() and not torch.equal(head, emb)


def test_init_section_builds_an_untied_model(tmp_path):
    from astraflow.runtime.model_build import build_model
    from astraflow.training.config import ModelInit

    assert ModelInit().tie_embeddings is True
    out = build_model(tmp_path / "m", ModelInit(preset="tiny", arch="llama", tie_embeddings=False))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_untied_model_trains_serves_and_loads_its_published_version(untied, tmp_path):
    from astraflow.rollout.engine import SamplingParams
    from astraflow.rollout.hf_engine import HFEngine
    from astraflow.rollout.weight_sync import VersionReader
    from astraflow.training.torch_backend import TorchBackend
    from storage.weights import WeightStore
    from tests.training.test_torch_backend import _batch

    be = TorchBackend(untied, lr=3e-3)
    q_bias = be.model.model.layers[0].self_attn.q_proj.bias.detach().clone()
    out = be.train_step(_batch(be.model, be.tokenizer))
    assert out["grad_norm"] > 0 and torch.isfinite(torch.tensor(out["loss"]))
    assert not torch.equal(be.model.model.layers[0].self_attn.q_proj.bias, q_bias)  # biases train

    engine = HFEngine(str(untied), device="cpu")
    prompt = engine.tokenizer("12+34=")["input_ids"]
    gen = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=4, greedy=True)))
    assert len(gen.tokens) >= 1

    store = WeightStore(tmp_path / "weights")
    be.publish(store, "p", 1)
    state, _ = VersionReader(str(tmp_path / "weights")).read("p", 1)
    assert "lm_head.weight" in state
    engine.load_weights(state, 1)
    served = dict(engine.model.named_parameters())
    assert not torch.equal(served["lm_head.weight"], served["model.embed_tokens.weight"])  # still untied
    for k, v in be.state_dict().items():
        assert torch.equal(served[k].detach(), v), k
    gen = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=4, greedy=True)))
    assert set(gen.versions.tolist()) == {1}


def test_a_directory_without_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    for load in (load_model, load_tokenizer, check_model_dir):
        with pytest.raises(ValueError, match=r"m is not an HF model directory \(no config.json\); build one"):
            load(tmp_path / "m")


def test_a_hub_cache_entry_names_its_snapshot(tiny_model, tmp_path):
    """``huggingface-cli download`` without ``--local-dir`` leaves ``models--org--name`` with the
    files in ``snapshots/<revision>`` (links into ``blobs``): pointed at the entry or at its
    ``snapshots``, the error names the revision ``refs/main`` names; the snapshot itself loads."""
    entry = tmp_path / "models--me--m"
    (entry / "blobs").mkdir(parents=True)
    for rev in ("old", "abc123"):
        (entry / "snapshots" / rev).mkdir(parents=True)
        for f in tiny_model.iterdir():
            blob = entry / "blobs" / f"{rev}-{f.name}"
            shutil.copyfile(f, blob)
            (entry / "snapshots" / rev / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("abc123")
    for where in (entry, entry / "snapshots"):
        for load in (load_model, check_model_dir):
            with pytest.raises(ValueError, match=rf"{where} is a Hugging Face hub cache entry, not a model "
                                                 rf"directory .*: point at the snapshot, {entry}/snapshots/abc123$"):
                load(where)
    check_model_dir(entry / "snapshots" / "abc123")
    res = _check(tmp_path, entry)
    assert res.exit_code == 2 and f"point at the snapshot, {entry}/snapshots/abc123" in res.output, res.output


def test_an_architecture_transformers_does_not_know(tiny_model, tmp_path):
    import transformers

    bad = _broken(tiny_model, tmp_path, "m")
    _edit_json(bad / "config.json", model_type="no_such_arch", architectures=["NoSuchForCausalLM"],
               auto_map={"AutoModelForCausalLM": "modeling_no_such.NoSuchForCausalLM"})
    for load in (load_model, check_model_dir):
        with pytest.raises(ValueError) as err:
            load(bad)
        msg = str(err.value)
        assert str(bad) in msg and "'no_such_arch'" in msg
        assert f"transformers {transformers.__version__} does not know" in msg
        assert "pip install -U transformers" in msg and "trust_remote_code" in msg


def test_an_architecture_that_is_not_a_causal_lm(tiny_model, tmp_path):
    bad = _broken(tiny_model, tmp_path, "m")
    (bad / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64}))
    with pytest.raises(ValueError, match="model_type 't5' is not a causal language model"):
        load_model(bad)


def test_a_directory_without_weights(tiny_model, tmp_path):
    bad = _broken(tiny_model, tmp_path, "m")
    (bad / "model.safetensors").unlink()
    for load in (load_model, check_model_dir):
        with pytest.raises(ValueError, match=r"has a config.json but no weights \(none of model.safetensors"):
            load(bad)


def _sentencepiece_tokenizer(tiny_model: Path, tmp_path: Path) -> Path:
    """A directory whose tokenizer is a sentencepiece ``tokenizer.model`` only (no tokenizer.json),
    as older Llama checkpoints ship it."""
    bad = _broken(tiny_model, tmp_path, "m")
    (bad / "tokenizer.json").unlink()
    (bad / "tokenizer.model").write_bytes(b"\x0a\x0b\x0a\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    _edit_json(bad / "tokenizer_config.json", tokenizer_class="LlamaTokenizer", backend="sentencepiece")
    return bad


def test_a_tokenizer_that_needs_sentencepiece(tiny_model, tmp_path):
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is not None:
        pytest.skip("sentencepiece is installed here: its absence cannot be shown")
    bad = _sentencepiece_tokenizer(tiny_model, tmp_path)
    for load in (load_tokenizer, load_model, check_model_dir):
        with pytest.raises(ValueError) as err:
            load(bad)
        msg = str(err.value)
        assert str(bad) in msg and "(LlamaTokenizer)" in msg
        assert "needs the Python package 'sentencepiece'" in msg and "pip install sentencepiece" in msg


def test_a_tokenizer_whose_import_fails_names_the_package(tiny_model, tmp_path, monkeypatch):
    """Whatever package a tokenizer class imports, its absence is named with the pip command;
    an error that names no missing package is passed on with the directory."""
    import transformers

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'rjieba'", name="rjieba")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", missing)
    with pytest.raises(ValueError, match=r"needs the Python package 'rjieba', which is not installed: pip install rjieba"):
        load_tokenizer(tiny_model)

    def protobuf(*args, **kwargs):
        raise ImportError("This tokenizer requires the protobuf library but it was not found in your environment.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", protobuf)
    import importlib.util

    if importlib.util.find_spec("google") is None or importlib.util.find_spec("google.protobuf") is None:
        with pytest.raises(ValueError, match="pip install protobuf"):
            load_tokenizer(tiny_model)

    def other(*args, **kwargs):
        raise OSError("tokenizer_config.json is truncated")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", other)
    with pytest.raises(ValueError, match=r"cannot be loaded by transformers .*OSError: tokenizer_config.json is truncated"):
        load_tokenizer(tiny_model)


def test_the_trainer_and_the_engines_fail_with_the_same_message(tiny_model, tmp_path):
    from astraflow.rollout.hf_engine import HFEngine
    from astraflow.rollout.process_engine import ProcessEngine
    from astraflow.training.torch_backend import TorchBackend

    bad = _broken(tiny_model, tmp_path, "m")
    (bad / "model.safetensors").unlink()
    builds = (TorchBackend, HFEngine,
              lambda path: ProcessEngine(path, max_batch_size=4))  # its process is never started
    for build in builds:
        with pytest.raises(ValueError, match="has a config.json but no weights"):
            build(str(bad))


def _check(tmp_path: Path, model: Path, **trainer):
    from astraflow.cli import main

    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(model)
    data["policies"][0].pop("init", None)
    if trainer:
        data["policies"][0]["trainer"] = trainer
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return CliRunner().invoke(main, ["check", str(cfg)])


@pytest.mark.parametrize("breakage, needle", [
    ("arch", "model_type 'no_such_arch' is an architecture transformers"),
    ("weights", "has a config.json but no weights"),
    ("config", "is not an HF model directory (no config.json)"),
])
def test_check_names_a_model_directory_that_cannot_be_loaded(tiny_model, tmp_path, breakage, needle):
    bad = _broken(tiny_model, tmp_path, "m")
    if breakage == "arch":
        _edit_json(bad / "config.json", model_type="no_such_arch")
    elif breakage == "weights":
        (bad / "model.safetensors").unlink()
    else:
        (bad / "config.json").unlink()
    res = _check(tmp_path, bad)
    assert res.exit_code == 2, res.output
    assert f"policies[solver].model: {bad}" in res.output, res.output
    assert needle in res.output and "Traceback" not in res.output


def test_check_accepts_an_untied_model(untied, tmp_path):
    res = _check(tmp_path, untied)
    assert res.exit_code == 0, res.output


def test_check_refuses_an_architecture_the_megatron_backend_cannot_train(tiny_model, untied, tmp_path):
    """Qwen2 (tied or not) passes for ``trainer.backend: megatron``; another causal LM that
    transformers knows is refused before any rank starts, naming the supported ones."""
    for model in (tiny_model, untied):
        res = _check(tmp_path, model, backend="megatron")
        assert res.exit_code == 0, res.output
    bad = _broken(tiny_model, tmp_path, "m")
    _edit_json(bad / "config.json", model_type="mistral", architectures=["MistralForCausalLM"])
    assert _check(tmp_path, bad).exit_code == 0  # the torch backend trains it
    res = _check(tmp_path, bad, backend="megatron")
    assert res.exit_code == 2, res.output
    assert f"policies[solver].model: {bad}: trainer.backend megatron cannot train it" in res.output
    assert "model_type 'mistral' is not supported" in res.output and "qwen2" in res.output
