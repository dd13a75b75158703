"""Numbers in a config (and in ``--set`` values) are read as YAML 1.2 reads them: ``010`` is 10
(YAML 1.1: octal 8), ``1e-1`` and ``1e3`` are floats (YAML 1.1: text, which a mix weight then
refused), and base-60 numbers (``12:00:00``) stay text."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.configerrors import load_yaml
from tests.test_cli_errors import _config, _invoke

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, value", [
    ("010", 10), ("-010", -10), ("0o17", 15), ("0x1F", 31), ("1_000", 1000), ("+3", 3),
    ("1e-1", 0.1), ("1e3", 1000.0), ("1.5E+3", 1500.0), (".5", 0.5), ("2.", 2.0), ("-.inf", float("-inf")),
    ("12:00:00", "12:00:00"), ("1e", "1e"), ("0b11", "0b11"), ("1__0", "1__0"),
])
def test_numbers_are_yaml_1_2(text, value):
    got = load_yaml(text)
    assert got == value and type(got) is type(value)


def test_a_leading_zero_is_no_octal_in_a_set(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "run.max_steps=010")
    assert res.exit_code == 0, res.output
    assert "max_steps: 10\n" in res.output


def test_a_mix_weight_in_exponent_form_is_a_number():
    res = _invoke("check", str(ROOT / "examples" / "math" / "mix.yaml"),
                  "--set", "workload.params.sources.add2.weight=1e-1")
    assert res.exit_code == 0, res.output
    assert "weight: 0.1\n" in res.output


def test_a_file_reads_numbers_the_same(tmp_path):
    path = _config(tmp_path)
    path.write_text(path.read_text().replace("max_steps: 4", "max_steps: 010").replace("batch_size: 16",
                                                                                         "batch_size: 1.6e1"))
    res = _invoke("check", str(path))
    assert res.exit_code == 0, res.output
    assert "max_steps: 10\n" in res.output and "batch_size: 16\n" in res.output
