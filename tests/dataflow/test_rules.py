"""Every shipped dataflow rule: its decision rule on hand-built inputs, a state save/restore
through JSON that continues with the same decisions (random streams included), and its typed
config (an unknown type or a bad parameter is a config error; user rules by module path)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import yaml

from astraflow.config import ConfigError, config_from_dict
from astraflow.dataflow import rules as R

ROOT = Path(__file__).resolve().parents[2]


def roundtrip(rule, registry, name, **params):
    """state_dict -> JSON -> a fresh instance (different seed) -> load_state_dict."""
    fresh = R.make(registry, name, params, seed=12345)
    fresh.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    return fresh


def decisions(curator, keys, n=200):
    return [curator.accept(keys[i % len(keys)], {}) for i in range(n)]


# -- curators: decision rules ------------------------------------------------------------------


def test_accept_all_accepts_everything():
    c = R.make(R.CURATORS, "accept_all", {})
    c.observe("p0", [1.0, 1.0])
    assert all(c.accept(f"p{i}", {}) for i in range(20))


def test_filter_solved_threshold_decay_and_explore():
    c = R.make(R.CURATORS, "filter_solved", {"threshold": 0.7, "decay": 0.5, "explore": 0.0})
    c.observe("p", [1, 1, 1, 1])  # first observation: the rate itself
    assert c.success["p"] == 1.0 and not c.accept("p", {})
    c.observe("p", [0, 0, 0, 0])  # EMA: 0.5 * 1.0 + 0.5 * 0.0
    assert c.success["p"] == pytest.approx(0.5) and c.accept("p", {})
    c.observe("p", [1, 1, 1, 0])  # 0.5 * 0.5 + 0.5 * 0.75
    assert c.success["p"] == pytest.approx(0.625) and c.accept("p", {})
    c.observe("p", [1, 1, 1, 1])  # 0.8125 > 0.7
    assert c.success["p"] == pytest.approx(0.8125) and not c.accept("p", {})
    assert c.accept("never_seen", {})
    # exactly at the threshold is still accepted (skip only *above* it)
    c.success["edge"] = 0.7
    assert c.accept("edge", {})
    # explore: a solved prompt is retried with probability ``explore``
    ex = R.make(R.CURATORS, "filter_solved", {"threshold": 0.5, "explore": 0.25}, seed=3)
    ex.observe("s", [1, 1])
    frac = sum(decisions(ex, ["s"], 4000)) / 4000
    assert frac == pytest.approx(0.25, abs=0.03)
    with pytest.raises(ValueError, match="threshold"):
        R.make(R.CURATORS, "filter_solved", {"threshold": 1.5})


def test_greso_skip_probability_grows_with_streak_and_keeps_floor():
    c = R.make(R.CURATORS, "greso", {"floor": 0.2, "base": 0.5})
    assert c.skip_probability("p") == 0.0
    probs = []
    for _ in range(5):
        c.observe("p", [1.0, 1.0, 1.0])  # zero variance: streak + 1
        probs.append(c.skip_probability("p"))
    # rate 1: 1 - 0.5^k, capped at 1 - floor
    assert probs == pytest.approx([0.5, 0.75, 0.8, 0.8, 0.8])
    c.observe("p", [0.0, 1.0, 1.0])  # variance again: the streak resets
    assert c.streak["p"] == 0 and c.skip_probability("p") == 0.0
    # the floor holds empirically: a prompt with a long streak is still tried ~floor of the time
    for _ in range(20):
        c.observe("q", [0.0, 0.0])
    c.rate = 1.0
    c.target_skip = 1.0  # keep the rate at 1 for this check
    frac = sum(decisions(c, ["q"], 4000)) / 4000
    assert frac == pytest.approx(0.2, abs=0.03)
    with pytest.raises(ValueError, match="floor"):
        R.make(R.CURATORS, "greso", {"floor": 0.0})


def test_greso_rate_adapts_to_the_target_skip_fraction():
    c = R.make(R.CURATORS, "greso", {"floor": 0.05, "base": 0.1, "target_skip": 0.3})
    for _ in range(10):
        c.observe("z", [1.0, 1.0])
    # every proposal is a zero-variance prompt: skips far above target -> the rate shrinks
    decisions(c, ["z"], 300)
    assert c.rate < 0.2
    low = c.rate
    assert c.skip_probability("z") == pytest.approx(min(0.95, low * (1 - 0.1**10)))
    # now only fresh prompts: skip fraction falls below target -> the rate grows back (<= 1)
    decisions(c, [f"fresh{i}" for i in range(50)], 2000)
    assert c.rate > low and c.rate <= 1.0
    assert 0.05 <= c.rate


def test_curriculum_weights_by_difficulty_from_outcomes():
    c = R.make(R.CURATORS, "curriculum", {"target": 0.5, "width": 0.35, "floor": 0.1})
    assert c.weight("unseen") == 1.0
    c.observe("mid", [1, 0, 1, 0])
    c.observe("solved", [1, 1, 1, 1])
    c.observe("hard", [0, 0, 0, 0])
    assert c.weight("mid") == pytest.approx(1.0)
    assert c.weight("solved") == pytest.approx(max(0.1, math.exp(-((0.5 / 0.35) ** 2))))
    assert c.weight("hard") == c.weight("solved") and c.weight("hard") < c.weight("mid")
    # the success rate is a 0.5 moving average of outcomes
    c.observe("solved", [0, 0, 1, 1])
    assert c.rate["solved"] == pytest.approx(0.75)
    # a very easy prompt never drops below the floor
    far = R.make(R.CURATORS, "curriculum", {"target": 0.0, "width": 0.1, "floor": 0.2})
    far.observe("x", [1, 1])
    assert far.weight("x") == pytest.approx(0.2)
    # acceptance frequency follows the weight
    c2 = R.make(R.CURATORS, "curriculum", {}, seed=1)
    c2.observe("s", [1, 1, 1, 1])
    frac = sum(decisions(c2, ["s"], 4000)) / 4000
    assert frac == pytest.approx(c2.weight("s"), abs=0.03)


# -- filters and orderings ---------------------------------------------------------------------


def test_group_filters():
    keep_all = R.make(R.FILTERS, "keep_all", {})
    assert keep_all.keep([1.0, 1.0]) == (True, None)
    dza = R.make(R.FILTERS, "drop_zero_advantage", {})
    assert dza.keep([1.0, 1.0, 1.0]) == (False, "zero_advantage")
    assert dza.keep([0.0, 0.0]) == (False, "zero_advantage")
    assert dza.keep([0.0, 1.0, 1.0]) == (True, None)
    assert dza.keep([0.5]) == (True, None)  # a single sequence has no group to compare to
    # restore is trivial but must round-trip
    assert roundtrip(dza, R.FILTERS, "drop_zero_advantage").keep([1.0, 1.0]) == (False, "zero_advantage")
    assert roundtrip(keep_all, R.FILTERS, "keep_all").keep([1.0, 1.0]) == (True, None)


def test_fifo_edf_and_freshest_orders():
    V = R.BufferedGroupView
    groups = [V(ingest_seq=3, oldest_version=5), V(ingest_seq=1, oldest_version=7),
              V(ingest_seq=2, oldest_version=4), V(ingest_seq=4, oldest_version=4)]
    fifo = R.make(R.ORDERINGS, "fifo", {})
    edf = R.make(R.ORDERINGS, "edf", {})
    assert fifo.order(groups, version=8, max_staleness=4) == [1, 2, 0, 3]
    # deadline = oldest_version + max_staleness: 4 (ingest 2), 4 (ingest 4), 5, 7
    assert edf.order(groups, version=8, max_staleness=4) == [2, 3, 0, 1]
    # freshest: newest oldest_version first, the later ready among equals: 7, 5, 4 (ingest 4), 4 (ingest 2)
    freshest = R.make(R.ORDERINGS, "freshest", {})
    assert freshest.order(groups, version=8, max_staleness=4) == [1, 0, 3, 2]
    for name, rule in (("fifo", fifo), ("edf", edf), ("freshest", freshest)):
        assert roundtrip(rule, R.ORDERINGS, name).order(groups, 8, 4) == rule.order(groups, 8, 4)


# -- save / restore of the stateful curators ---------------------------------------------------


@pytest.mark.parametrize(
    "name,params",
    [
        ("accept_all", {}),
        ("filter_solved", {"threshold": 0.6, "explore": 0.3}),
        ("greso", {"floor": 0.1, "base": 0.3, "target_skip": 0.4}),
        ("curriculum", {"target": 0.5, "width": 0.3}),
    ],
)
def test_curator_state_roundtrip_continues_the_same_decisions(name, params):
    keys = [f"p{i}" for i in range(8)]
    outcomes = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 1],
                [0, 0, 0, 0], [1, 1, 1, 1]]
    a = R.make(R.CURATORS, name, params, seed=7)
    for k, r in zip(keys, outcomes):
        a.observe(k, r)
        a.observe(k, r)
    decisions(a, keys, 50)  # advance the random stream
    restored = roundtrip(a, R.CURATORS, name, **params)
    assert json.dumps(restored.state_dict(), sort_keys=True) == json.dumps(a.state_dict(), sort_keys=True)
    # both continue identically: same decisions, and observations keep them in step
    for r in range(3):
        assert decisions(restored, keys, 100) == decisions(a, keys, 100)
        for k, o in zip(keys, outcomes[r:] + outcomes[:r]):
            a.observe(k, o)
            restored.observe(k, o)
    assert restored.state_dict() == a.state_dict()


def test_restore_without_rng_state_is_accepted_and_foreign_state_rejected():
    a = R.make(R.CURATORS, "filter_solved", {})
    a.observe("p", [1, 1])
    old_format = {k: v for k, v in a.state_dict().items() if k != "rng_state"}
    b = R.make(R.CURATORS, "filter_solved", {})
    b.load_state_dict(old_format)
    assert b.success == {"p": 1.0}
    with pytest.raises(ValueError, match="unknown keys"):
        b.load_state_dict(R.make(R.CURATORS, "greso", {}).state_dict())


@pytest.mark.parametrize("name,saved,config", [
    ("filter_solved", {"threshold": 0.9, "explore": 0.1}, {"threshold": 0.3, "explore": 0.0}),
    ("greso", {"floor": 0.1, "target_skip": 0.5}, {"floor": 0.5, "target_skip": 0.2}),
    ("curriculum", {"target": 0.5, "width": 0.35}, {"target": 0.8, "width": 0.1}),
])
def test_a_resumed_rule_takes_its_parameters_from_the_config(name, saved, config):
    """A rule's parameters are configuration, not state: a run resumed with other values uses
    them, also from a state saved with the parameters in it (an earlier release)."""
    a = R.make(R.CURATORS, name, saved)
    a.observe("p", [1, 0])
    state = a.state_dict()
    assert not set(saved) & set(state)
    for st in (state, {**state, **saved}):
        b = R.make(R.CURATORS, name, config)
        b.load_state_dict(json.loads(json.dumps(st)))
        assert {k: getattr(b, k) for k in config} == config
        assert b.state_dict() == state


# -- typed config ------------------------------------------------------------------------------

STAGES = {"curator": R.CURATORS, "group_filter": R.FILTERS, "ordering": R.ORDERINGS}
SHIPPED = {"curator": ["accept_all", "filter_solved", "greso", "curriculum"],
           "group_filter": ["keep_all", "drop_zero_advantage"], "ordering": ["fifo", "edf", "freshest"]}


def run_config(tmp_path, **dataflow):
    """The tiny example config with ``dataflow`` changes, validated as ``astraflow check`` does."""
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path)
    data["policies"][0].pop("init")
    data["dataflow"].update(dataflow)
    return config_from_dict(data)


@pytest.mark.parametrize("stage, bad, needle", [
    ("curator", {"type": "no_such"},
     # (the known list also holds the test rules of tests.dataflow.user_rules once another test imported it)
     r"dataflow.curator: unknown prompt curator 'no_such'; known: accept_all, curriculum, (.+, )?filter_solved, greso"),
    ("group_filter", {"type": "keep_some"}, r"dataflow.group_filter: .*known: drop_zero_advantage, keep_all"),
    ("ordering", {"type": "lifo"}, r"dataflow.ordering: .*known: edf, fifo, freshest"),
    ("ordering", {"params": {}}, r"dataflow.ordering: needs a `type:`"),
    ("curator", "no_such", r"dataflow.curator: unknown prompt curator 'no_such'"),
    ("curator", {"type": "filter_solved", "params": {"threshold": 1.5}},
     r"dataflow.curator.params.threshold: Input should be less than or equal to 1"),
    ("curator", {"type": "greso", "params": {"floor": 0}},
     r"dataflow.curator.params.floor: Input should be greater than 0"),
    ("curator", {"type": "curriculum", "params": {"widht": 0.2}}, r"dataflow.curator.params.widht: unknown key"),
    ("group_filter", {"type": "keep_all", "params": {"seed": 1}}, r"dataflow.group_filter.params.seed: unknown key"),
    ("curator", {"type": "no_such.module:rule"}, r"dataflow.curator.type: .*cannot import 'no_such.module'"),
    ("curator", {"type": "tests.dataflow.user_rules:every_nth_test", "params": {"n": 0}},
     r"dataflow.curator.params.n: Input should be greater than or equal to 1"),
    ("curator", {"type": "tests.dataflow.user_rules:nope"},
     r"'tests.dataflow.user_rules' has no 'nope' and registered no prompt curator .*; known: .*greso"),
    ("curator", {"type": "tests.dataflow.user_rules:EveryNht"},
     r"has no 'EveryNht' .*; did you mean tests.dataflow.user_rules:EveryNth\? known: "),
    # a class of the module that is no rule of this stage is no hint (EveryNth is a curator)
    ("ordering", {"type": "tests.dataflow.user_rules:EveryNht"}, r"has no 'EveryNht' and registered no buffer "
     r"ordering of that name; known: "),
    # a module attribute that is not a rule class (its params model): a config error, no traceback
    ("curator", {"type": "tests.dataflow.user_rules:EveryNthParams"},
     r"prompt curator tests.dataflow.user_rules:EveryNthParams is not a rule class"),
    ("ordering", {"type": "tests.dataflow.user_rules:Field"}, r"is not a rule class"),
    # a rule class without the state methods (not a RuleBase), by its name or its registered name
    ("curator", {"type": "tests.dataflow.user_rules:Stateless"},
     r"Stateless lacks state_dict, load_state_dict: subclass astraflow.dataflow.rules.RuleBase"),
    ("curator", {"type": "tests.dataflow.user_rules:stateless_test"}, r"stateless_test lacks state_dict"),
    ("ordering", {"type": "tests.dataflow.user_rules:EveryNth"}, r"EveryNth lacks order: .*define the stage's order"),
])
def test_an_unknown_type_or_a_bad_param_is_a_config_error_naming_the_field(tmp_path, stage, bad, needle):
    with pytest.raises(ConfigError, match=needle):
        run_config(tmp_path, **{stage: bad})


def test_every_shipped_rule_builds_from_its_default_config(tmp_path):
    for stage, names in SHIPPED.items():
        for name in names:  # each has its own typed model (tests may register more rules: user rules)
            spec = getattr(run_config(tmp_path, **{stage: {"type": name}}).dataflow, stage)
            assert type(spec).__name__.endswith("Rule") and spec.type == name
            rule = R.make(STAGES[stage], spec.type, spec.params, seed=1)
            assert type(rule) is STAGES[stage].get(name) and isinstance(rule.state_dict(), dict)
            # the defaults live once, in the rule's Params model
            assert spec.params == type(rule).Params()
    # the resolved config (written into the run directory) validates again to the same rules
    cfg = run_config(tmp_path, curator={"type": "greso", "params": {"floor": 0.3}}, ordering={"type": "edf"})
    again = run_config(tmp_path, **{k: cfg.dataflow.model_dump(mode="json")[k] for k in SHIPPED})
    assert again.dataflow == cfg.dataflow and again.dataflow.curator.params.floor == 0.3


def test_params_reach_the_rule_and_the_run_seed_unless_given():
    c = R.make(R.CURATORS, "curriculum", {"target": 0.3})
    assert (c.target, c.width, c.floor) == (0.3, 0.35, 0.1)
    same = [R.make(R.CURATORS, "greso", p, seed=s)._rng.random() for p, s in (({}, 5), ({"seed": 5}, 9), ({}, 9))]
    assert same[0] == same[1] != same[2]


def test_a_user_rule_named_by_module_path_runs_in_the_data_layer(tmp_path):
    from tests.dataflow.test_data_layer import make_layer

    cfg = run_config(tmp_path, curator={"type": "tests.dataflow.user_rules:every_nth_test", "params": {"n": 3}})
    assert cfg.dataflow.curator.type == "tests.dataflow.user_rules:every_nth_test"
    layer = make_layer(tmp_path, curator=cfg.dataflow.curator)
    assert layer.curator.n == 3

    async def go():
        tasks = await layer.lease("n", 8)
        keys = {layer.buffers.rolling[t.group_id].prompt_key for t in tasks}
        assert keys and all(int(k[1:]) % 3 == 0 for k in keys)

    asyncio.run(go())


@pytest.mark.parametrize("stage, name", [("curator", "filter_solved"), ("group_filter", "drop_zero_advantage"),
                                         ("ordering", "freshest"), ("curator", "tests.dataflow.user_rules:EveryNth")])
def test_a_rule_named_alone_is_that_rule_with_its_default_params(tmp_path, stage, name):
    """``curator: filter_solved`` (what ``--set dataflow.curator=filter_solved`` writes) is
    ``{type: filter_solved}``."""
    assert getattr(run_config(tmp_path, **{stage: name}).dataflow, stage) == \
        getattr(run_config(tmp_path, **{stage: {"type": name}}).dataflow, stage)


@pytest.mark.parametrize("curator", ["filter_solved", "curriculum", "greso"])
def test_success_curators_count_an_agentic_episodes_success_not_its_shaped_return(tmp_path, curator):
    """A multi-turn episode's reward is its return (shaping and invalid-call penalties included):
    a failed episode that made progress has a positive one, a solved one with penalties may not.
    ``filter_solved`` and ``curriculum`` estimate success rates, so they observe the episode's
    ``success`` (what evaluation counts); ``greso`` predicts zero advantage, so it keeps the returns."""
    from dataclasses import replace

    from tests.dataflow.helpers import make_trajectory, store_and_ref
    from tests.dataflow.test_data_layer import make_layer

    layer = make_layer(tmp_path, group_size=4, batch_size=8, curator=curator)
    seen = []
    observe = layer.curator.observe
    layer.curator.observe = lambda key, values: (seen.append(list(values)), observe(key, values))[1]

    async def go():
        writer = layer.store.writer("n0")
        tasks = await layer.lease("n0", 8)  # two groups of four
        returns = [0.3, 0.2, 0.3, 0.1, -0.2, -0.1, -0.2, -0.3]  # group 1 failed with progress, group 2 solved
        trajs = [replace(make_trajectory(t, r), score=float(i >= 4), stats={"turns": 3.0, "success": float(i >= 4)})
                 for i, (t, r) in enumerate(zip(tasks, returns))]
        await layer.complete(store_and_ref(writer, trajs))

    asyncio.run(go())
    if curator == "greso":
        assert seen == [[0.3, 0.2, 0.3, 0.1], [-0.2, -0.1, -0.2, -0.3]]
    else:
        assert seen == [[0.0] * 4, [1.0] * 4]
