"""Typed workload params: the config rejects a bad or unknown param naming the field, keeps
``params`` as written, and a workload's seed defaults to ``workload.seed``."""

import pytest
from pydantic import ValidationError

from astraflow.workloads.base import make_workload
from astraflow.workloads.config import WorkloadConfig
from astraflow.workloads.math import MathConfig


@pytest.mark.parametrize("name, params, loc, needle", [
    ("math", {"digits": 0}, ("params", "digits"), "greater than or equal to 1"),
    ("math", {"ops": ["/"]}, ("params", "ops", 0), "'+', '-' or '*'"),
    ("math", {"digitz": 1}, ("params", "digitz"), "unknown param of workload 'math'; did you mean digits?"),
    ("mix", {"sources": {"a": {"workload": "math", "weight": 0}}}, ("params", "sources"), "source 'a' has weight 0"),
    ("nope", {}, ("name",), "unknown workload 'nope'; known: "),  # the shipped ones and any a test registered
])
def test_config_names_the_bad_field(name, params, loc, needle):
    with pytest.raises(ValidationError) as err:
        WorkloadConfig(name=name, params=params)
    e = err.value.errors()[0]
    assert e["loc"] == loc and needle in str(err.value)


def test_params_kept_as_written_and_seed_defaults_to_the_workloads():
    params = {"digits": 1, "ops": ["+", "*"]}
    cfg = WorkloadConfig(name="math", params=params, seed=5)
    assert cfg.params == params and cfg.model_dump()["params"] == params
    assert make_workload(cfg.name, cfg.params, cfg.seed).cfg == MathConfig(digits=1, ops=("+", "*"), seed=5)
    assert make_workload("math", {"seed": 3}, 5).cfg.seed == 3
    mix = make_workload("mix", {"sources": {"a": {"workload": "math", "params": params}}}, 7)
    assert mix.sources["a"].cfg.seed == 7
