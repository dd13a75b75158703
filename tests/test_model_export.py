"""``astraflow export``: a run's committed weight version as an HF model directory that
transformers loads back to the trained weights, and a new run can start from."""

import errno
import json
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.model_export import PROVENANCE, ExportError, committed_versions, export_version
from astraflow.models import init_model
from astraflow.training.torch_backend import TorchBackend
from astraflow.weightconv import hf_to_megatron
from storage import holds
from storage.paths import RunPaths
from storage.weights import WeightStore


def _trained(model_dir, seed: int = 0, **kw) -> TorchBackend:
    """A backend whose weights moved away from the model directory's (as training moves them)."""
    be = TorchBackend(str(model_dir), lr=1e-3, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in be.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return be


def _run_dir(tmp_path, model_dir, policies=("solver",)):
    run = tmp_path / "run"
    RunPaths(run).make()
    RunPaths(run).config.write_text(yaml.safe_dump({"policies": [{"name": p, "model": str(model_dir)}
                                                                 for p in policies]}))
    return run


def _one_version(tmp_path, model_dir, versions=(1,)):
    """A run directory whose policy ``solver`` has published ``versions``, trained away from ``model_dir``."""
    run = _run_dir(tmp_path, model_dir)
    store, be = WeightStore(RunPaths(run).weights), _trained(model_dir)
    for v in versions:
        be.publish(store, "solver", v)
    return run


def _logits(model, ids=(5, 17, 42, 99, 3)):
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits.float()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama with a separate output head (the tied case is ``tiny_model``)."""
    return init_model(tmp_path_factory.mktemp("models") / "llama", preset="tiny", arch="llama", seed=2,
                      tie_word_embeddings=False)


@pytest.mark.parametrize("which", ["tiny_model", "llama"])
def test_export_loads_back_to_the_trained_weights(which, request, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(which)
    run = _run_dir(tmp_path, model_dir)
    be = _trained(model_dir)
    be.publish(WeightStore(RunPaths(run).weights), "solver", 7)
    lines = []
    record = export_version(run, tmp_path / "out", say=lines.append)
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    be.model.eval()
    assert torch.allclose(_logits(out), _logits(be.model), atol=1e-5)
    assert not torch.allclose(_logits(out), _logits(base), atol=1e-2)  # the trained weights, not the start
    assert record["version"] == 7 and record["probe_checked"] and record["probe_error_nats"] < 1e-4
    assert json.loads((tmp_path / "out" / PROVENANCE).read_text())["source_model"] == str(model_dir)
    assert out.config.tie_word_embeddings == base.config.tie_word_embeddings
    assert any("exported solver v7" in line for line in lines)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_new_run_starts_from_the_export(tiny_model, tmp_path):
    """The export is a model directory ``astraflow check`` accepts as ``policies[].model``."""
    run = _one_version(tmp_path, tiny_model)
    export_version(run, tmp_path / "out", say=lambda _: None)
    res = CliRunner().invoke(main, ["check", "examples/tiny/config.yaml", "--set",
                                    f"policies.0.model={tmp_path / 'out'}"])
    assert res.exit_code == 0, res.output
    assert str(tmp_path / "out") in res.output


def test_dtype_auto_keeps_the_published_and_narrowing_is_reported(tiny_model, tmp_path):
    from safetensors import safe_open

    run = _run_dir(tmp_path, tiny_model)
    _trained(tiny_model, publish_dtype="bf16").publish(WeightStore(RunPaths(run).weights), "solver", 1)
    export_version(run, tmp_path / "auto", say=lambda _: None)
    with safe_open(str(tmp_path / "auto" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    run2 = _run_dir(tmp_path / "b", tiny_model)
    _trained(tiny_model).publish(WeightStore(RunPaths(run2).weights), "solver", 1)
    record = export_version(run2, tmp_path / "narrow", dtype="bf16", say=lambda _: None)
    assert record["published_dtype"] == "fp32" and record["dtype"] == "bf16"
    assert 0 < record["probe_error_nats"] < 0.05  # bf16 rounding, reported, not refused


def test_megatron_layout_exports_in_hf_names(llama, tmp_path):
    from astraflow.probe import make_probe
    from transformers import AutoModelForCausalLM

    run = _run_dir(tmp_path, llama)
    be = _trained(llama)
    hf = {k: v.detach().clone() for k, v in be.model.state_dict().items()}
    config = be.model.config.to_dict()
    WeightStore(RunPaths(run).weights).publish(
        "solver", 3, hf_to_megatron(hf, config),
        meta={"layout": "megatron", "hf_config": config, "dtype": "fp32", "probe": make_probe(be.model)})
    export_version(run, tmp_path / "out", say=lambda _: None)
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for k, v in out.state_dict().items():
        assert torch.equal(v, hf[k]), k


def test_a_config_that_does_not_describe_the_weights_exports_nothing(tiny_model, tmp_path):
    run = _run_dir(tmp_path, tiny_model)
    store = WeightStore(RunPaths(run).weights)
    be = _trained(tiny_model)
    state = {k: v.detach().clone() for k, v in be.model.state_dict().items()}
    config = be.model.config.to_dict()
    from astraflow.probe import make_probe

    store.publish("solver", 2, state, meta={"layout": "hf", "probe": make_probe(be.model),
                                            "config": {**config, "rope_parameters": {"rope_type": "default",
                                                                                     "rope_theta": 7.0}}})
    with pytest.raises(ExportError, match="does not describe the trained model"):
        export_version(run, tmp_path / "out", version=2, say=lambda _: None)
    store.publish("solver", 3, state, meta={"layout": "hf", "config": {**config, "hidden_size": 32}})
    with pytest.raises(ExportError, match="do not fit the architecture"):
        export_version(run, tmp_path / "out", version=3, say=lambda _: None)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_refusals_name_the_fix(tiny_model, tmp_path):
    run = _run_dir(tmp_path, tiny_model, policies=("a", "b"))
    with pytest.raises(ExportError, match="no committed weight version yet"):
        export_version(run, tmp_path / "o", say=print)
    store = WeightStore(RunPaths(run).weights, keep_last=2)
    be = _trained(tiny_model)
    for v in (1, 2, 3):
        be.publish(store, "a", v)
    store.apply_retention("a")
    be.publish(store, "b", 1)
    with pytest.raises(ExportError, match="trains 2 policies .*--policy NAME"):
        export_version(run, tmp_path / "o", say=print)
    with pytest.raises(ExportError, match="--policy c: .* it has a, b"):
        export_version(run, tmp_path / "o", policy="c", say=print)
    with pytest.raises(ExportError, match=r"--version 1: a has committed versions v2, v3; .*keep_versions"):
        export_version(run, tmp_path / "o", policy="a", version=1, say=print)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ExportError, match="no export of this tool"):
        export_version(run, tmp_path / "mine", policy="a", force=True, say=print)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "x"
    with pytest.raises(ExportError, match="is no run directory"):
        export_version(tmp_path / "mine", tmp_path / "o", say=print)


def test_an_earlier_export_is_replaced_only_with_force(tiny_model, tmp_path):
    run = _run_dir(tmp_path, tiny_model)
    store = WeightStore(RunPaths(run).weights)
    _trained(tiny_model, seed=1).publish(store, "solver", 1)
    export_version(run, tmp_path / "out", say=print)
    _trained(tiny_model, seed=2).publish(store, "solver", 2)
    with pytest.raises(ExportError, match="pass --force"):
        export_version(run, tmp_path / "out", say=print)
    assert json.loads((tmp_path / "out" / PROVENANCE).read_text())["version"] == 1
    export_version(run, tmp_path / "out", force=True, say=print)
    assert json.loads((tmp_path / "out" / PROVENANCE).read_text())["version"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]


def test_tokenizer_from_elsewhere_when_the_model_directory_is_gone(tmp_path):
    model_dir = init_model(tmp_path / "m", preset="tiny", seed=4)
    run = _run_dir(tmp_path, model_dir)
    be = _trained(model_dir)
    be.publish(WeightStore(RunPaths(run).weights), "solver", 1)
    be.tokenizer.save_pretrained(tmp_path / "tok")
    for f in model_dir.iterdir():
        f.unlink()
    model_dir.rmdir()
    with pytest.raises(ExportError, match="pass --tokenizer DIR"):
        export_version(run, tmp_path / "out", say=print)
    export_version(run, tmp_path / "out", tokenizer=tmp_path / "tok", say=print)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_a_tokenizer_of_another_vocabulary_than_the_runs_is_refused(tiny_model, tmp_path):
    """While the run's model directory exists, --tokenizer must have its vocabulary (a copy with
    another chat template is fine): another would pair the trained ids with other text."""
    from astraflow.models import build_bpe_tokenizer

    run = _one_version(tmp_path, tiny_model)
    other = tmp_path / "bpe"
    build_bpe_tokenizer([f"{i} plus {i * 7} is {i * 8}" for i in range(200)], vocab_size=300).save_pretrained(other)
    with pytest.raises(ExportError, match=rf"--tokenizer {other} has another vocabulary than the tokenizer the run "
                                          rf"trained with, in {tiny_model} .*leave --tokenizer out"):
        export_version(run, tmp_path / "out", tokenizer=other, say=print)
    assert not (tmp_path / "out").exists()
    same = tmp_path / "same"
    shutil.copytree(tiny_model, same)
    export_version(run, tmp_path / "out", tokenizer=same, say=print)


@pytest.mark.parametrize("content", [None, "{}", "garbage"])
def test_a_tokenizer_directory_without_usable_files_is_named_with_the_fix(content, tiny_model, tmp_path):
    """A --tokenizer directory with no tokenizer files, or broken ones: exit 2 naming the option, no traceback."""
    run = _one_version(tmp_path, tiny_model)
    tok = tmp_path / "tok"
    tok.mkdir()
    if content is not None:
        (tok / "tokenizer.json").write_text(content)
    res = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "out"), "--tokenizer", str(tok)])
    assert res.exit_code == 2 and f"--tokenizer {tok}" in res.output, res.output
    assert "tokenizer files" in res.output and not (tmp_path / "out").exists()


def test_a_store_it_may_only_read_is_read_without_a_hold(tiny_model, tmp_path, monkeypatch):
    """A run directory of another user: no hold file can be written, the files' checksums are checked."""
    run = _one_version(tmp_path, tiny_model)

    def no_write(*_a, **_k):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(holds, "take", no_write)
    lines = []
    export_version(run, tmp_path / "out", say=lines.append)
    assert any("no read hold taken" in line for line in lines)


def test_cli_lists_versions_and_exits_2_on_bad_input(tiny_model, tmp_path):
    run = _one_version(tmp_path, tiny_model, versions=(4, 5))
    assert [r["version"] for r in committed_versions(run)["solver"]] == [4, 5]
    res = CliRunner().invoke(main, ["export", str(run), "--list"])
    assert res.exit_code == 0 and "solver v4: train step 4, fp32, hf layout" in res.output, res.output
    res = CliRunner().invoke(main, ["export", str(run)])
    assert res.exit_code == 2 and "name the output directory" in res.output
    res = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "o"), "--list"])
    assert res.exit_code == 2 and "--list writes nothing" in res.output and not (tmp_path / "o").exists()
    res = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "o"), "--version", "9"])
    assert res.exit_code == 2 and "v4, v5" in res.output
    assert "v9 is not committed yet" in res.output and "keep_versions" not in res.output, res.output
    res = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "o"), "--max-shard-size", "abc"])
    assert res.exit_code == 2 and "--max-shard-size 'abc'" in res.output, res.output
    res = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "o"), "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    man = RunPaths(run).weights / "solver" / "v00000004" / "manifest.json"
    man.write_text("{damaged")
    res = CliRunner().invoke(main, ["export", str(run), "--list"])
    assert res.exit_code == 0 and "solver v4: damaged" in res.output and "solver v5: train step" in res.output


def test_a_live_run_going_on_during_the_export_cannot_retire_the_version(tiny_model, tmp_path, monkeypatch):
    """The run publishes and applies retention while the export works: the version stays held."""
    import astraflow.model_export as mx

    run = _run_dir(tmp_path, tiny_model)
    store = WeightStore(RunPaths(run).weights, keep_last=1)
    be = _trained(tiny_model)
    be.publish(store, "solver", 1)
    real = mx._tokenizer

    def while_the_run_goes_on(*a, **k):
        for v in (2, 3, 4):
            be.publish(store, "solver", v)
            store.apply_retention("solver")
        return real(*a, **k)

    monkeypatch.setattr(mx, "_tokenizer", while_the_run_goes_on)
    record = export_version(run, tmp_path / "out", say=print)
    assert record["version"] == 1 and store.versions("solver") == [1, 4]  # held: retention kept it
    store.apply_retention("solver")
    assert store.versions("solver") == [4]  # released at the end


def test_a_damaged_shard_is_refused_not_exported(tiny_model, tmp_path):
    run = _run_dir(tmp_path, tiny_model)
    wv = _trained(tiny_model).publish(WeightStore(RunPaths(run).weights), "solver", 1)
    shard = next(p for p in (tmp_path / "run" / "weights" / "solver").glob(f"v*{wv.version}/*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the weights
    shard.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"solver v1 is damaged .*--list"):
        export_version(run, tmp_path / "out", say=print)
    assert not (tmp_path / "out").exists()


def test_older_readers_find_their_keys_and_the_tokenizer_files_are_the_runs(tiny_model, tmp_path):
    run = _one_version(tmp_path, tiny_model)
    export_version(run, tmp_path / "out", say=print)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] and cfg["torch_dtype"] == "float32"
    for f in tiny_model.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name


def test_out_may_be_a_symlink_or_a_directory_made_for_it(tiny_model, tmp_path):
    import os
    import stat

    run = _one_version(tmp_path, tiny_model)
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o2770)
    (tmp_path / "link").symlink_to(tmp_path / "shared")
    export_version(run, tmp_path / "link", say=print)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "shared" / PROVENANCE).is_file()
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o2770  # the directory made for it stays
    assert not [p for p in (tmp_path / "shared").iterdir() if p.name.startswith(".")]
    export_version(run, tmp_path / "shared", force=True, say=print)  # an earlier export replaced in place
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o2770
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ExportError, match="which does not exist"):
        export_version(run, tmp_path / "dangling", say=print)


def test_what_a_killed_export_left_is_removed_by_the_next(tiny_model, tmp_path):
    import subprocess

    run = _one_version(tmp_path, tiny_model)
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f".out.{dead.pid}.0123456789ab.tmp"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"partial")
    export_version(run, tmp_path / "out", say=print)
    assert not left.exists() and (tmp_path / "out" / PROVENANCE).is_file()


def test_a_sim_run_has_no_model_to_export(tmp_path, tiny_model):
    run = _run_dir(tmp_path, tiny_model)
    WeightStore(RunPaths(run).weights).publish("solver", 1, {"sim.steps": torch.tensor([1])},
                                               meta={"sim": True, "train_steps": 1})
    with pytest.raises(ExportError, match="sim trainer, which trains no model"):
        export_version(run, tmp_path / "out", say=print)


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("200kb", 200_000), ("1000", 1000), ("3 MB", 3 * 10**6)])
def test_shard_sizes(text, size):
    from astraflow.model_export import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["abc", "0", "-5MB", "5GiB", "1e9", ""])
def test_bad_shard_sizes_name_the_form(text):
    from astraflow.model_export import parse_size

    with pytest.raises(ExportError, match="--max-shard-size"):
        parse_size(text)


def test_written_files_follow_the_umask(tiny_model, tmp_path):
    import os
    import stat

    run = _one_version(tmp_path, tiny_model)
    before = os.umask(0o022)
    try:
        export_version(run, tmp_path / "out", say=print)
    finally:
        os.umask(before)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()} == {0o644}


def test_a_damaged_newest_version_points_at_the_others(tiny_model, tmp_path):
    run = _one_version(tmp_path, tiny_model, versions=(1, 2))
    man = RunPaths(run).weights / "solver" / "v00000002" / "manifest.json"
    man.write_text(man.read_text() + "garbage")
    with pytest.raises(ExportError, match=r"solver v2 is damaged .*--version N"):
        export_version(run, tmp_path / "out", say=print)
    assert export_version(run, tmp_path / "out", version=1, say=print)["version"] == 1


def test_only_a_dead_exports_leftovers_of_this_out_are_removed(tiny_model, tmp_path):
    """``.ckpt.100.<pid>...`` is a live export's into ``ckpt.100``, not a dead one's into ``ckpt``."""
    import os

    run = _one_version(tmp_path, tiny_model)
    other = tmp_path / f".ckpt.100.{os.getpid()}.0123456789ab.tmp"
    other.mkdir()
    export_version(run, tmp_path / "ckpt", say=print)
    assert other.is_dir()


def test_a_file_systems_root_with_lost_and_found_is_an_empty_out(tiny_model, tmp_path):
    run = _one_version(tmp_path, tiny_model)
    (tmp_path / "mnt" / "lost+found").mkdir(parents=True)
    export_version(run, tmp_path / "mnt", say=print)
    export_version(run, tmp_path / "mnt", force=True, say=print)
    assert (tmp_path / "mnt" / "lost+found").is_dir() and (tmp_path / "mnt" / PROVENANCE).is_file()


def test_the_export_commands_a_finished_run_prints_each_export_a_policy(tiny_model, tmp_path):
    """What `astraflow run` prints at its end, pasted: a two-policy run's commands name the policy
    (export refuses to guess between them), and each one exports that policy."""
    import shlex

    from astraflow.runtime.launch import export_hints
    from tests.conftest import tiny_config

    run = _run_dir(tmp_path, tiny_model, policies=("solver", "verifier"))
    store, be = WeightStore(RunPaths(run).weights), _trained(tiny_model)
    for p in ("solver", "verifier"):
        be.publish(store, p, 1)
    cfg = tiny_config(tiny_model, workload__workflow="solver_verifier",
                      policies=[{"name": "solver", "model": str(tiny_model)},
                                {"name": "verifier", "model": str(tiny_model)}])
    hints = export_hints(cfg, run)
    assert len(hints) == 2
    for hint, policy in zip(hints, ("solver", "verifier")):
        out = tmp_path / f"out-{policy}"
        args = shlex.split(hint.split(": ", 1)[1].replace(" OUT", f" {out}"))
        assert args[:2] == ["astraflow", "export"], hint
        res = CliRunner().invoke(main, args[1:])
        assert res.exit_code == 0, (hint, res.output)
        assert json.loads((out / PROVENANCE).read_text())["policy"] == policy
    assert export_hints(tiny_config(tiny_model), run) == [f"the trained model as an HF directory: "
                                                          f"astraflow export {run} OUT"]
