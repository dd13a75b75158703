"""A model directory's weights checked against the model its config describes (the costly part
of ``check_model_dir``: building the model imports its modelling code) are checked once for the
same config, tensor names and shapes and transformers: a later check of an identical directory
builds nothing, one that differs in any of them is checked again, and a cache that cannot be
written only means the check runs every time."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from astraflow import checked, model_loading
from astraflow.models import check_model_dir


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """The directories whose model the check built, in order (a cache of this test's own)."""
    monkeypatch.delenv("ASTRAFLOW_CACHE_DIR", raising=False)  # the XDG place, as for a user
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = []
    meta = model_loading._meta_model

    def recording(p):
        built.append(p)
        return meta(p)

    monkeypatch.setattr(model_loading, "_meta_model", recording)
    return built


def test_a_pass_is_remembered_for_identical_directories_only(tiny_model, tmp_path, builds):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    check_model_dir(tiny_model, tokenizer=False)
    check_model_dir(tiny_model, tokenizer=False)
    check_model_dir(copy, tokenizer=False)  # the same config and weights elsewhere
    assert builds == [tiny_model]
    assert (tmp_path / "cache" / "astraflow" / "checked").stat().st_mode & 0o777 == 0o700
    # the config changed (shapes the weights do not have): checked again, and refused
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    with pytest.raises(ValueError, match="config.json does not describe the weights next to it"):
        check_model_dir(copy, tokenizer=False)
    with pytest.raises(ValueError, match="config.json does not describe"):  # a refusal is not remembered
        check_model_dir(copy, tokenizer=False)
    assert builds == [tiny_model, copy, copy]


def test_a_check_that_changed_or_another_transformers_checks_again(tiny_model, tmp_path, builds, monkeypatch):
    import transformers

    check_model_dir(tiny_model, tokenizer=False)
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    check_model_dir(tiny_model, tokenizer=False)
    source = tmp_path / "model_loading.py"  # the checking code, edited
    source.write_text(open(model_loading.__file__).read() + "\n# changed\n")
    key = checked.check_key("weights-against-model", {"x": 1}, model_loading.__file__)
    assert key != checked.check_key("weights-against-model", {"x": 1}, source)
    assert builds == [tiny_model, tiny_model]


def test_a_cache_that_cannot_be_written_leaves_the_check_running(tiny_model, tmp_path, builds, monkeypatch):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("ASTRAFLOW_CACHE_DIR", str(blocked))
    check_model_dir(tiny_model, tokenizer=False)
    check_model_dir(tiny_model, tokenizer=False)
    assert builds == [tiny_model, tiny_model]


def test_the_cache_directories_made_are_not_writable_by_others_whatever_the_umask(tmp_path, monkeypatch):
    """A missing ``~/.cache`` made under umask 000 would let others rename ``astraflow/checked`` and
    put marks of their own there (and plant files for every other program that uses the cache)."""
    monkeypatch.delenv(checked.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / "cache"))
    old = os.umask(0)
    try:
        checked.remember_pass("some-check")
    finally:
        os.umask(old)
    assert checked.passed_before("some-check")
    for d in (tmp_path / "home", tmp_path / "home" / "cache", tmp_path / "home" / "cache" / "astraflow"):
        assert not d.stat().st_mode & 0o022, (d, oct(d.stat().st_mode))
