"""Config errors name a path a user can write or ``--set``, and the fix: never the tag of a union
member (a dataflow rule's ``type``); a boolean is never taken as a number, nor judged as one by a
check across fields; a value where a section is wanted is told the section's switch or keys; an
unknown workload param is told the workload's params, and an unknown key its section's keys."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from astraflow.configbase import Strict
from astraflow.dataflow.rules import RuleBase
from tests.test_cli_errors import _config, _invoke

HERE = "tests.test_config_error_paths"


# -- rules and a workload of a user's module (named by module path, not registered) ---------------

class MinMeanParams(Strict):
    min_mean: float = -1.0


class MinMean(RuleBase):
    """A group filter with a parameter."""

    Params = MinMeanParams

    def keep(self, rewards):
        return True, None


class NewestParams(Strict):
    window: int = Field(default=4, ge=1)


class Newest(RuleBase):
    """A buffer ordering with a parameter."""

    Params = NewestParams

    def order(self, groups, version, max_staleness):
        return list(range(len(groups)))


class EchoParams(BaseModel):  # a plain pydantic model, as docs/extending.md shows
    model_config = ConfigDict(extra="forbid", frozen=True)
    size: int = 100


class Echo:
    """A workload whose params model is not a ``Strict`` one."""

    Params = EchoParams

    def __init__(self, seed: int = 0, **params):
        self.p = EchoParams(**params)

    def tasks(self, split):
        return [{"question": f"say {i}", "answer": str(i)} for i in range(self.p.size)]

    def render_prompt(self, payload):
        return payload["question"]

    def reward(self, completion, payload):
        return float(completion.strip() == payload["answer"])

    def source_weights(self):
        return {"": 1.0}


def _errors(output: str) -> list[str]:
    """The lines of an ``invalid config`` message, one per error."""
    return [line.strip() for line in output.split("invalid config:", 1)[-1].splitlines() if line.strip()]


def _check(tmp_path, *settings: str):
    return _invoke("check", str(_config(tmp_path)), *[arg for s in settings for arg in ("--set", s)])


# -- a union member's tag is no part of a path ----------------------------------------------------

TAGS = {"user", "accept_all", "filter_solved", "greso", "curriculum", "keep_all", "drop_zero_advantage", "fifo",
        "edf", "freshest"}


@pytest.mark.parametrize("settings, line, fix", [
    (["dataflow.curator.type=filter_solved", "dataflow.curator.params.threshold=2"],
     "dataflow.curator.params.threshold: Input should be less than or equal to 1, got 2", "0.5"),
    (["dataflow.curator.type=greso", "dataflow.curator.params.floor=0"],
     "dataflow.curator.params.floor: Input should be greater than 0, got 0", "0.2"),
    (["dataflow.curator.type=curriculum", "dataflow.curator.params.widht=0.2"],
     "dataflow.curator.params.widht: unknown key", None),
    (["dataflow.group_filter.type=drop_zero_advantage", "dataflow.group_filter.params.floor=1"],
     "dataflow.group_filter.params.floor: unknown key", None),
    (["dataflow.ordering.type=edf", "dataflow.ordering.params.window=1"],
     "dataflow.ordering.params.window: unknown key", None),
    (["dataflow.curator.type=tests.dataflow.user_rules:every_nth_test", "dataflow.curator.params.n=0"],
     "dataflow.curator.params.n: Input should be greater than or equal to 1, got 0", "3"),
    ([f"dataflow.group_filter.type={HERE}:MinMean", "dataflow.group_filter.params.min_mean=low"],
     "dataflow.group_filter.params.min_mean: Input should be a valid number", "0.5"),
    ([f"dataflow.ordering.type={HERE}:Newest", "dataflow.ordering.params.window=0"],
     "dataflow.ordering.params.window: Input should be greater than or equal to 1, got 0", "2"),
    ([f"dataflow.ordering.type={HERE}:Newest", "dataflow.ordering.params.windo=2"],
     "dataflow.ordering.params.windo: unknown key", None),
    (["dataflow.curator.type=no_such.module:rule"],
     "dataflow.curator.type: prompt curator no_such.module:rule: cannot import 'no_such.module'", "accept_all"),
    # a rule the file leaves at its default keeps its type: the param is what is wrong, not a missing `type:`
    (["dataflow.curator.params.threshold=0.5"], "dataflow.curator.params.threshold: unknown key", None),
    (["dataflow.ordering.params.window=1"], "dataflow.ordering.params.window: unknown key", None),
])
def test_a_rule_error_names_the_path_to_set_not_the_union_tag(tmp_path, settings, line, fix):
    res = _check(tmp_path, *settings)
    assert res.exit_code == 2, res.output
    errors = _errors(res.output)
    assert len(errors) == 1 and errors[0].startswith(line), res.output
    path = line.split(": ", 1)[0]
    assert not TAGS & set(path.split(".")[2:-1]), path
    if fix is not None:  # the path printed is the one --set takes
        res = _check(tmp_path, *settings, f"{path}={fix}")
        assert res.exit_code == 0, res.output


# -- a boolean is never a number -------------------------------------------------------------------

BOOL = "Input should be {}, got the boolean true (YAML reads true, false, yes, no, on, off as booleans)"


@pytest.mark.parametrize("settings, line", [
    (["dataflow.batch_size=true"], "dataflow.batch_size: " + BOOL.format("an integer")),
    (["dataflow.batch_size=true", "dataflow.replay_ratio=0.5"], "dataflow.batch_size: " + BOOL.format("an integer")),
    (["workload.group_size=true"], "workload.group_size: " + BOOL.format("an integer")),
    (["partitions.trainer.nodes=true"], "partitions[trainer].nodes: " + BOOL.format("an integer")),
])
def test_a_boolean_for_a_number_is_the_only_error_checks_across_fields_add_none(tmp_path, settings, line):
    """``true`` is not taken as 1: no "batch_size (1) must be a multiple of group_size" after it."""
    res = _check(tmp_path, *settings)
    assert res.exit_code == 2, res.output
    assert len(_errors(res.output)) == 1 and _errors(res.output)[0].startswith(line), res.output


def test_a_boolean_for_a_number_fails_the_field_of_any_section():
    from astraflow.dataflow.config import DataflowConfig
    from astraflow.sections import AutoscaleConfig
    from astraflow.training.config import TrainerConfig
    from astraflow.workloads.config import SamplingConfig

    for model, data, loc in [(DataflowConfig, {"batch_size": True}, ("batch_size",)),
                             (SamplingConfig, {"max_new_tokens": True}, ("max_new_tokens",)),
                             (AutoscaleConfig, {"high_wait": False}, ("high_wait",)),
                             (TrainerConfig, {"sim_step_schedule": {3: True}}, ("sim_step_schedule", 3))]:
        with pytest.raises(ValidationError) as err:
            model.model_validate(data)
        assert [(e["type"], e["loc"]) for e in err.value.errors()] == [("bool_number", loc)], model


# -- a value where a section is wanted -------------------------------------------------------------

@pytest.mark.parametrize("setting, line, follow", [
    ("cluster.tls=false", "cluster.tls: is a section, not a value (got false); set e.g. cluster.tls.enabled=false",
     "cluster.tls.enabled=false"),
    ("autoscale=true", "autoscale: is a section, not a value (got true); set e.g. autoscale.enabled=true", None),
    ("workload.sampling=3", "workload.sampling: is a section, not a value (got 3); set its keys (temperature, top_p, "
     "max_new_tokens), e.g. workload.sampling.temperature=...", "workload.sampling.temperature=0.7"),
])
def test_a_value_for_a_section_names_its_switch_or_its_keys(tmp_path, setting, line, follow):
    res = _check(tmp_path, setting)
    assert res.exit_code == 2, res.output
    assert _errors(res.output) == [line], res.output
    if follow is not None:
        res = _check(tmp_path, follow)
        assert res.exit_code == 0, res.output


def test_an_empty_params_of_a_rule_that_takes_none_says_so(tmp_path):
    """``params:`` left empty in YAML is null: a section with no keys, not a crash."""
    res = _check(tmp_path, "dataflow.ordering.type=fifo", "dataflow.ordering.params=null")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert _errors(res.output) == ["dataflow.ordering.params: is a section that takes no keys, not a value (got "
                                   "null); leave it out or write {}"], res.output


# -- an unknown workload param ---------------------------------------------------------------------

@pytest.mark.parametrize("settings, line", [
    (["workload.params.digit=2"],
     "workload.params.digit: unknown param of workload 'math'; did you mean digits? (its params: digits, num_test, "),
    (["workload.params.zzz=2"], "workload.params.zzz: unknown param of workload 'math' (its params: digits, "),
    ([f"workload.name={HERE}:Echo", "workload.params={sise: 3}"],
     f"workload.params.sise: unknown param of workload '{HERE}:Echo'; did you mean size? (its params: size)"),
    ([f"workload.name={HERE}:Echo", "workload.params={size: true}"],
     "workload.params.size: " + BOOL.format("an integer")),
])
def test_an_unknown_workload_param_names_the_workloads_params(tmp_path, settings, line):
    res = _check(tmp_path, *settings)
    assert res.exit_code == 2, res.output
    assert len(_errors(res.output)) == 1 and _errors(res.output)[0].startswith(line), res.output
    assert "docs/configuration.md" not in res.output


# -- an unknown key ---------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, line", [
    (["rollout.capcity=3"], "rollout.capcity: unknown key; did you mean capacity? (its keys: engine, capacity, "),
    (["policies.solver.trainer.lrr=1e-4"], "policies[solver].trainer.lrr: unknown key; did you mean lr? (its keys: "),
    (["cluster.tls.enable=false"], "cluster.tls.enable: unknown key; did you mean enabled? (its keys: enabled, "),
    (["dataflow.curator.type=curriculum", "dataflow.curator.params.widht=0.2"],
     "dataflow.curator.params.widht: unknown key; did you mean width? (its keys: seed, target, width, floor)"),
    (["dataflow.ordering.type=edf", "dataflow.ordering.params.window=1"],
     "dataflow.ordering.params.window: unknown key; this section takes no keys"),
    (["autoscale={hi: 1}"], "autoscale.hi: unknown key (its keys: enabled, high_wait, low_wait, "),
])
def test_an_unknown_key_is_told_the_nearest_key_and_its_sections_keys(tmp_path, settings, line):
    """As an unknown workload param is: a misspelt key names the one meant, not only the docs."""
    res = _check(tmp_path, *settings)
    assert res.exit_code == 2, res.output
    assert len(_errors(res.output)) == 1 and _errors(res.output)[0].startswith(line), res.output


def test_an_unknown_key_of_a_partition_file_is_told_the_partitions_keys(tmp_path):
    (tmp_path / "p.yaml").write_text("name: x\nnodez: 3\n")
    res = _invoke("partitions", "add", str(tmp_path), "--from-yaml", str(tmp_path / "p.yaml"))
    assert res.exit_code == 2 and "nodez: unknown key; did you mean nodes? (its keys: name, " in res.output, res.output
