import pytest
from hypothesis import given
from hypothesis import strategies as st

from astraflow.workloads.math import MathConfig, accuracy, format_prompt, make_dataset, math_reward, parse_answer


def test_splits_disjoint_deterministic_and_correct():
    cfg = MathConfig(digits=2, num_test=None)
    train, test = make_dataset(cfg, "train"), make_dataset(cfg, "test")
    assert len(train) + len(test) == 100 * 100
    assert not {x["question"] for x in train} & {x["question"] for x in test}
    assert 0.07 < len(test) / 10000 < 0.13
    assert make_dataset(cfg, "train") == train
    assert make_dataset(MathConfig(digits=2, num_test=None, seed=1), "train") != train
    for it in train[:50]:
        a, b = it["question"].split("+")
        assert int(it["answer"]) == int(a) + int(b)


def test_sampled_large_space_and_ops():
    cfg = MathConfig(digits=5, ops=("+", "-", "*"), num_train=300, num_test=50)
    train, test = make_dataset(cfg, "train"), make_dataset(cfg, "test")
    assert len(train) == 300 and len(test) == 50
    assert not {x["question"] for x in train} & {x["question"] for x in test}
    assert len({x["question"] for x in train}) == 300
    assert {op for x in train for op in "+-*" if op in x["question"]} == {"+", "-", "*"}


def test_from_mapping_and_errors():
    assert MathConfig.from_any({"digits": 1, "ops": ["+"]}) == MathConfig(digits=1)
    with pytest.raises(ValueError, match=r"unknown params \[.digitz.\]"):
        MathConfig.from_any({"digitz": 1})
    with pytest.raises(ValueError, match="split"):
        make_dataset(None, "val")
    with pytest.raises(ValueError, match="ops"):
        MathConfig(ops=("/",))


def test_reward_examples():
    assert format_prompt({"question": "12+34"}) == "12+34="
    assert math_reward("46", "46") == 1.0
    assert math_reward(" 46", 46) == 1.0
    assert math_reward("= 46 because", "46") == 1.0
    assert math_reward("46<|im_end|>", "46") == 1.0
    assert math_reward("-5", "-5") == 1.0
    assert math_reward("460", "46") == 0.0
    assert math_reward("4 6", "46") == 0.0
    assert math_reward("", "46") == 0.0
    assert math_reward("abc", "46") == 0.0
    assert parse_answer("x") is None
    assert accuracy(["1", "3"], [{"answer": "1"}, {"answer": "2"}]) == 0.5


@given(st.integers(-10**9, 10**9), st.text(alphabet=" =", max_size=3), st.text(alphabet="abc .\n", max_size=5))
def test_reward_tolerates_prefix_and_suffix(n, pre, post):
    assert math_reward(f"{pre}{n}{post}", str(n)) == 1.0


@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_reward_rejects_wrong(n, m):
    assert math_reward(str(n), str(m)) == (1.0 if n == m else 0.0)


def test_more_problems_than_a_sampled_split_holds_is_refused_not_drawn_forever():
    from astraflow.workloads.math import make_dataset

    with pytest.raises(ValueError, match="num_test 5000 is more than half the ~2000 problems the test split"):
        make_dataset({"digits": 3, "ops": ["+", "-"], "test_fraction": 0.001, "num_test": 5000}, "test")
