"""A user's dataflow rule that raises, returns the wrong shape or keeps state that is not plain
JSON: the error names the rule (``dataflow.<stage> (<type>)``) instead of the node or trainer
that called it, and a state that could not be saved is refused rather than coerced."""

from __future__ import annotations

import asyncio

import pytest

from astraflow.dataflow import rules as R
from tests.dataflow.test_data_layer import Node, make_layer

HERE = "tests.dataflow.bad_user_rules"


def test_a_raising_curator_is_named_with_its_error(tmp_path, caplog):
    layer = make_layer(tmp_path, curator={"type": f"{HERE}:Boom"})
    with caplog.at_level("ERROR", logger="astraflow.dataflow"), pytest.raises(
            R.RuleError, match=r"dataflow\.curator \(tests\.dataflow\.bad_user_rules:Boom\)\.accept "
                               r"raised KeyError: 'curator_bug' \(at .*bad_user_rules\.py:\d+ in accept\)"):
        asyncio.run(layer.lease("n", 8))
    _ends_the_run(layer, "accept raised KeyError")
    # the whole traceback once, in the data layer's log, down to the user's own line
    logged = [r for r in caplog.records if "accept raised" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info[2] is not None
    assert "curator_bug" in "".join(__import__("traceback").format_exception(*logged[0].exc_info))


def test_a_filter_returning_a_bare_bool_is_told_the_shape(tmp_path):
    layer = make_layer(tmp_path, group_filter={"type": f"{HERE}:BareKeep"})
    with pytest.raises(R.RuleError, match=r"dataflow\.group_filter \(.*BareKeep\)\.keep returned True: "
                                          r"a group filter's keep must return \(bool, reason-or-None\)"):
        asyncio.run(Node(layer).roll(8))
    _ends_the_run(layer, "keep returned True")


def test_a_rule_failing_inside_a_library_is_named_at_its_own_line(tmp_path):
    layer = make_layer(tmp_path, group_filter={"type": f"{HERE}:EmptyMean"})
    with pytest.raises(R.RuleError, match=r"\.keep raised StatisticsError: .* \(at .*bad_user_rules\.py:\d+ in keep\)"):
        asyncio.run(Node(layer).roll(8))


def _ends_the_run(layer, what: str) -> None:
    """The data layer's status carries the rule's failure, which the orchestrator ends the run
    with (no node is replaced for it)."""
    from astraflow.runtime.stopping import rule_failed

    why = rule_failed(asyncio.run(layer.state()))
    assert why is not None and what in why and why.endswith("again on this directory to resume)")


def test_an_ordering_that_leaves_groups_out_is_named():
    rule = R.make(R.ORDERINGS, f"{HERE}:Dropper", {})
    views = [R.BufferedGroupView(i, 0) for i in range(3)]
    with pytest.raises(R.RuleError, match=r"dataflow\.ordering \(.*Dropper\)\.order returned 1 indices for 3"):
        rule.order(views, 0, 1)


def test_a_state_that_is_not_plain_json_is_refused_when_built():
    with pytest.raises(R.RuleError, match=r"dataflow\.curator \(.*SetState\)\.state_dict is not plain JSON: "
                                          r"state\['seen'\] is a builtins\.set \(use a list\)"):
        R.make(R.CURATORS, f"{HERE}:SetState", {})


def test_a_state_that_turns_non_json_is_refused_at_the_save_naming_the_rule(tmp_path):
    layer = make_layer(tmp_path, curator={"type": f"{HERE}:TupleKeys"})
    asyncio.run(Node(layer).roll(8))  # groups end: the curator observes them
    with pytest.raises(R.RuleError, match=r"dataflow\.curator \(.*TupleKeys\)\.state_dict is not plain JSON: "
                                          r"state\['pairs'\] has the key \('p\d+', 4\) of type tuple"):
        layer.state_dict()


def test_checked_rules_keep_their_type_state_and_decisions():
    c = R.make(R.CURATORS, "greso", {}, seed=3)
    assert type(c) is R.Greso and set(c.state_dict()) == {"streak", "rate", "proposed", "skipped", "rng_state"}
    c.observe("p1", [1.0, 1.0])
    fresh = R.make(R.CURATORS, "greso", {}, seed=9)
    fresh.load_state_dict(c.state_dict())
    assert [fresh.accept("p1", {}) for _ in range(50)] == [c.accept("p1", {}) for _ in range(50)]
    f = R.make(R.FILTERS, "drop_zero_advantage", {})
    assert f.keep([1.0, 1.0]) == (False, "zero_advantage") and f.keep([0.0, 1.0]) == (True, None)


def test_plain_json_problem_names_what_is_wrong():
    assert R.plain_json_problem({"a": [1, 2.5, "x", None, True, {"b": []}]}) is None
    assert R.plain_json_problem({"a": (1, 2)}) == "state['a'] is a builtins.tuple (use a list)"
    assert "of type int" in R.plain_json_problem({"a": {1: 2}})


def test_a_rule_whose_state_could_never_be_saved_is_a_config_error(tmp_path):
    """``astraflow check`` builds a user's rule: a state of sets is refused with the config's
    other errors, naming the field, before anything starts."""
    from astraflow.config import ConfigError
    from tests.dataflow.test_rules import run_config

    with pytest.raises(ConfigError, match=r"dataflow.curator.params: .*SetState.*state_dict is not plain JSON"):
        run_config(tmp_path, curator={"type": f"{HERE}:SetState"})
