"""Mixing several workloads by weight: the ``mix`` workload (split, dispatch, validation) and
the data layer's mixing before rollout and at batch time, driven directly (no Dask) against a
real in-memory Zarr store with a scripted node running concurrently with the trainer."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from pathlib import Path

import pytest
import yaml

from astraflow.config import ConfigError, config_from_dict

from astraflow.dataflow.config import DataflowConfig, DropZeroAdvantageRule

from astraflow.workloads.config import EvalConfig, WorkloadConfig
from astraflow.dataflow.layer import BatchTimeout, DataLayer
from astraflow.workloads.base import WORKLOADS, make_workload
from astraflow.workloads.math import format_prompt, make_dataset

from tests.dataflow.helpers import make_trajectory, store_and_ref

ROOT = Path(__file__).resolve().parents[2]
ADD = {"digits": 1, "ops": ["+"], "num_test": 10}
MUL = {"digits": 1, "ops": ["*"], "num_test": 10}


def sources(**weights: float) -> dict:
    """``a``: 1-digit addition, ``b``: 1-digit multiplication, ``c``: 1-digit subtraction."""
    params = {"a": ADD, "b": MUL, "c": {"digits": 1, "ops": ["-"], "num_test": 10}}
    return {name: {"workload": "math", "weight": w, "params": params[name]} for name, w in weights.items()}


def make_layer(tmp_path, workload_name="mix", params=None, group_size=4, batch_size=16, eval_every=0,
               state_path=None, num_prompts=4, **df) -> DataLayer:
    return DataLayer(
        dataflow=DataflowConfig(batch_size=batch_size, **df),
        workload=WorkloadConfig(name=workload_name, params=params or {}, group_size=group_size,
                                eval=EvalConfig(every=eval_every, num_prompts=num_prompts)),
        policies=["p"],
        store_url=f"memory://{uuid.uuid4().hex}",
        metrics_path=str(tmp_path / "metrics.jsonl"),
        max_steps=1000,
        state_path=state_path,
    )


def mixed_reward(t) -> float:
    """Rewards 0,1,0,1 within a group: never filtered."""
    return float(int(t.task_id.split("/")[1]) % 2)


async def serve(layer: DataLayer, n_batches: int, reward_of=mixed_reward, timeout: float = 10.0,
                leased: dict | None = None):
    """A node rolls out whatever is leasable while a trainer takes ``n_batches`` batches.
    ``leased`` collects ``task_id -> prompt`` of every leased train task, in lease order."""
    writer = layer.store.writer("n0")
    stop = asyncio.Event()
    leased = {} if leased is None else leased

    async def node():
        while not stop.is_set():
            tasks = await layer.lease("n0", 8)
            leased.update((t.task_id, t.prompt) for t in tasks if t.kind == "train")
            if tasks:
                trajs = [make_trajectory(t, reward_of(t), version=layer.versions["p"], node="n0") for t in tasks]
                await layer.complete(store_and_ref(writer, trajs))
            await asyncio.sleep(0.001 if tasks else 0.01)

    task = asyncio.create_task(node())
    try:
        batches = []
        for v in range(n_batches):  # each batch trained on: its version committed
            batches.append(await layer.next_batch("p", v, timeout=timeout))
            await layer.published("p", v + 1)
        return batches
    finally:
        stop.set()
        await task


def batch_sources(batch, leased: dict) -> Counter:
    """Sequences of each source in a batch, from the leased tasks' prompts (not the metrics)."""
    return Counter(leased[i.task_id]["source"] for i in batch.items)


# -- the workload ------------------------------------------------------------------------------


def test_mixture_splits_tag_and_interleave():
    wl = make_workload("mix", {"sources": sources(a=3, b=1)}, 0)
    assert wl.source_weights() == {"a": 3.0, "b": 1.0}
    add_train, mul_train = make_dataset({**ADD, "seed": 0}, "train"), make_dataset({**MUL, "seed": 0}, "train")
    train = wl.tasks("train")
    assert [p for p in train if p["source"] == "a"] == [{**p, "source": "a"} for p in add_train]
    assert [p for p in train if p["source"] == "b"] == [{**p, "source": "b"} for p in mul_train]
    assert len(train) == len(add_train) + len(mul_train)
    # eval: round-robin, so any prefix holds both sources
    ev = wl.tasks("eval")
    assert [p["source"] for p in ev[:6]] == ["a", "b"] * 3
    assert sorted(p["question"] for p in ev) == sorted(p["question"] for p in
                                                       make_dataset({**ADD, "seed": 0}, "test")
                                                       + make_dataset({**MUL, "seed": 0}, "test"))


def test_mixture_dispatches_prompt_and_reward_to_the_source():
    @WORKLOADS.register("shout_test")
    class Shout:
        def __init__(self, seed: int = 0):
            pass

        def tasks(self, split):
            return [{"question": "hi", "answer": "HI"}]

        def render_prompt(self, payload):
            return payload["question"] + "!"

        def reward(self, completion, payload):
            return float(completion == payload["answer"])

    wl = make_workload("mix", {"sources": {"m": {"workload": "math", "params": MUL},
                                           "s": {"workload": "shout_test", "weight": 0.5}}}, 0)
    mul = next(p for p in wl.tasks("train") if p["source"] == "m" and p["answer"] not in ("0",))
    s = next(p for p in wl.tasks("train") if p["source"] == "s")
    assert wl.render_prompt(mul) == format_prompt(mul) and wl.render_prompt(s) == "hi!"
    assert wl.reward(mul["answer"], mul) == 1.0 and wl.reward("HI", mul) == 0.0
    assert wl.reward("HI", s) == 1.0 and wl.reward(mul["answer"], s) == 0.0
    with pytest.raises(ValueError, match="source 'x'"):
        wl.reward("1", {**mul, "source": "x"})


@pytest.mark.parametrize("params, needle", [
    ({}, "at least one source"),
    ({"sources": {}}, "at least one source"),
    ({"sources": sources(a=1), "extra": 1}, r"unknown params \['extra'\]"),
    ({"sources": {"a": {"workload": "math", "weight": 0}}}, "source 'a' has weight 0; set weight to a number > 0"),
    ({"sources": {"a": {"workload": "math", "weight": -1}}}, "source 'a' has weight -1"),
    ({"sources": {"a": {"workload": "math", "weight": "3"}}}, "source 'a' has weight '3'"),
    ({"sources": {"a": {"workload": "math", "digits": 2}}}, r"source 'a' has unknown keys \['digits'\].*under params"),
    ({"sources": {"a": {"weight": 1}}}, "source 'a' needs `workload"),
    ({"sources": {"a": {"workload": "nope"}}}, "source 'a': unknown workload 'nope'; known: .*math"),
    ({"sources": {"a": {"workload": "math", "params": {"digits": 0}}}}, "source 'a': math workload: digits"),
    ({"sources": {"a": {"workload": "calculator"}}}, "calculator is agentic"),
    ({"sources": {"a": {"workload": "mix"}}}, "itself a mix"),
])
def test_mixture_rejects_bad_sources(params, needle):
    with pytest.raises(ValueError, match=needle):
        make_workload("mix", params, 0)


def test_mixture_rejects_a_source_that_uses_the_source_key():
    @WORKLOADS.register("has_source_key_test")
    class HasSource:
        def __init__(self, seed: int = 0):
            pass

        def tasks(self, split):
            return [{"question": "q", "source": "web"}]

    wl = make_workload("mix", {"sources": {"w": {"workload": "has_source_key_test"}}}, 0)
    with pytest.raises(ValueError, match="source 'w' .* already uses the payload key 'source'"):
        wl.tasks("train")


def test_bad_mix_is_a_config_error_and_the_example_parses(tmp_path):
    from click.testing import CliRunner

    from astraflow.cli import main

    data = yaml.safe_load((ROOT / "examples" / "math" / "mix.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "model")  # built from init: (not built here)
    cfg = config_from_dict(data)
    assert cfg.workload.name == "mix" and set(cfg.workload.params["sources"]) == {"add2", "mul1"}
    data["workload"]["params"]["sources"]["mul1"]["weight"] = 0
    with pytest.raises(ConfigError, match="source 'mul1' has weight 0"):
        config_from_dict(data)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["check", str(tmp_path / "bad.yaml")])
    assert res.exit_code == 2 and "set weight to a number > 0" in res.output and "Traceback" not in res.output
    data["workload"]["params"]["sources"]["mul1"]["weight"] = 1
    data["policies"][0]["init"]["warm_start_seconds"] = 10
    with pytest.raises(ConfigError, match="warm_start_seconds: the supervised warm start trains on the math"):
        config_from_dict(data)
    # a warm start bounded in steps only is named by the field that asks for it, and so is the fix
    del data["policies"][0]["init"]["warm_start_seconds"]
    data["policies"][0]["init"]["warm_start_steps"] = 30
    with pytest.raises(ConfigError, match=r"init\.warm_start_steps: the supervised warm start trains on the math.*"
                                          r"drop warm_start_steps \(and leave warm_start_seconds at 0\)"):
        config_from_dict(data)


# -- the data layer: before rollout ------------------------------------------------------------


def test_refill_bounds_each_source_by_its_share(tmp_path):
    layer = make_layer(tmp_path, params={"sources": sources(a=3, b=1)}, prefetch_groups=4)

    async def go():
        tasks = await layer.lease("n", 1000)
        groups = Counter(t.prompt["source"] for t in tasks if t.task_id.endswith("/0"))
        # limit 4 + 4 = 8 groups ahead, split 3:1
        assert groups == {"a": 6, "b": 2}
        assert (await layer.state())["sources"]["a"]["groups_created"] == 6

    asyncio.run(go())


def test_refill_follows_weights_over_time(tmp_path):
    layer = make_layer(tmp_path, params={"sources": sources(a=1, b=2, c=1)})

    async def go():
        await serve(layer, 20)
        created = layer.mixer.groups_by_source()
        total = sum(created.values())
        for s, share in {"a": 0.25, "b": 0.5, "c": 0.25}.items():
            assert created[s] / total == pytest.approx(share, abs=0.05), created

    asyncio.run(go())


# -- the data layer: at batch time -------------------------------------------------------------


def test_batch_composition_3_to_1_every_batch(tmp_path):
    layer = make_layer(tmp_path, params={"sources": sources(a=3, b=1)})

    async def go():
        leased: dict = {}
        batches = await serve(layer, 12, leased=leased)
        for batch in batches:
            assert len(batch) == 16
            assert batch_sources(batch, leased) == {"a": 12, "b": 4}
            assert batch.metrics["consumed_by_source"] == {"a": 12, "b": 4}
        assert layer.mixer.consumed_by_source("p") == {"a": 144, "b": 48}

    asyncio.run(go())


def test_batch_composition_thirds_in_the_long_run(tmp_path):
    """Weights 1:1:1, 4 groups a batch: some batch needs 2 groups of a source. With no
    prefetch the bound must be per source (a global bound of 4 groups, full with 2+1+1 ahead,
    would never refill the source that the next batch needs twice: a deadlock)."""
    layer = make_layer(tmp_path, params={"sources": sources(a=1, b=1, c=1)}, prefetch_groups=0)

    async def go():
        leased: dict = {}
        batches = await serve(layer, 30, leased=leased)  # 120 groups: 40 each exactly
        totals = Counter()
        for batch in batches:
            got = batch_sources(batch, leased)
            assert sum(got.values()) == 16 and all(v % 4 == 0 for v in got.values())  # whole groups
            assert max(got.values()) <= 8
            totals.update(got)
        assert totals == {"a": 160, "b": 160, "c": 160}
        # credits stay bounded and sum to 0
        credit = layer.mixer.credit["p"]
        assert sum(credit.values()) == pytest.approx(0, abs=1e-9) and max(map(abs, credit.values())) < 1

    asyncio.run(go())


def test_quotas_apportion_fractional_shares_exactly(tmp_path):
    """Weights 2:1 with 4 groups per batch: 8/3 and 4/3 groups; carried credit makes it exact
    every 3 batches (8 and 4 groups)."""
    layer = make_layer(tmp_path, params={"sources": sources(a=2, b=1)})
    totals = Counter()
    for i in range(9):
        quota, layer.mixer.credit["p"] = layer.mixer.quotas("p", 16)
        assert sum(quota.values()) == 16 and all(v % 4 == 0 for v in quota.values())
        totals.update(quota)
        if i % 3 == 2:
            assert totals == {"a": 32 * (i + 1) // 3, "b": 16 * (i + 1) // 3}
    # with replay a batch needs 10 of 16 sequences: parts of groups go by credit too
    totals = Counter()
    for _ in range(6):
        quota, layer.mixer.credit["p"] = layer.mixer.quotas("p", 10)
        assert sum(quota.values()) == 10
        totals.update(quota)
    assert totals == {"a": 40, "b": 20}


def test_filtered_source_gets_more_rollouts_and_batches_still_fill(tmp_path):
    """Source ``b`` (multiplication) yields zero-advantage groups for every prompt whose answer
    is even (about 3/4 of 1-digit products): they are dropped, ``b`` is rolled out more often,
    and every batch still holds its 1:1 share."""
    layer = make_layer(tmp_path, params={"sources": sources(a=1, b=1)},
                       group_filter=DropZeroAdvantageRule(), prefetch_groups=0)

    def reward_of(t):
        if t.prompt["source"] == "b" and int(t.prompt["answer"]) % 2 == 0:
            return 1.0
        return mixed_reward(t)

    async def go():
        batches = await serve(layer, 8, reward_of=reward_of)
        for batch in batches:
            assert batch.metrics["consumed_by_source"] == {"a": 8, "b": 8}
        created = layer.mixer.groups_by_source()
        assert created["b"] >= 2 * created["a"], created
        assert layer.ledger.dropped_by_reason["zero_advantage"] > 0

    asyncio.run(go())


def test_timeout_names_the_short_source(tmp_path):
    layer = make_layer(tmp_path, params={"sources": sources(a=1, b=1)},
                       group_filter=DropZeroAdvantageRule())

    async def go():
        with pytest.raises(BatchTimeout, match=r"short: source 'b' 0/8"):
            await serve(layer, 1, reward_of=lambda t: 1.0 if t.prompt["source"] == "b" else mixed_reward(t),
                        timeout=1.0)
        assert layer.mixer.short == {}

    asyncio.run(go())


# -- state, evaluation, one source -------------------------------------------------------------


def test_credit_and_prompt_orders_saved_and_restored(tmp_path):
    params = {"sources": sources(a=1, b=1, c=1)}
    layer = make_layer(tmp_path, params=params)

    async def go():
        await serve(layer, 2)

    asyncio.run(go())
    state = json.loads(json.dumps(layer.state_dict()))
    assert state["mix_credit"]["p"] == layer.mixer.credit["p"] and any(state["mix_credit"]["p"].values())
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    resumed = make_layer(tmp_path, params=params, state_path=str(path))
    assert resumed.mixer.credit == layer.mixer.credit
    assert resumed.mixer.order == layer.mixer.order and resumed.mixer.epoch == layer.mixer.epoch
    # the next batches are apportioned the same way
    for _ in range(5):
        q1, c1 = layer.mixer.quotas("p", 16)
        q2, c2 = resumed.mixer.quotas("p", 16)
        assert q1 == q2 and c1 == c2
        layer.mixer.credit["p"], resumed.mixer.credit["p"] = c1, c2
    # a fresh layer (no state) starts from zero credit: it would apportion differently
    assert make_layer(tmp_path, params=params).mixer.credit != layer.mixer.credit


def test_eval_reports_accuracy_by_source(tmp_path):
    layer = make_layer(tmp_path, params={"sources": sources(a=1, b=1)}, eval_every=1, num_prompts=4)

    async def go():
        tasks = [t for t in await layer.lease("n", 100) if t.kind == "eval"]
        assert [t.prompt["source"] for t in tasks] == ["a", "b", "a", "b"]
        w = layer.store.writer("n")
        rewards = {"a": [1.0, 1.0], "b": [0.0, 1.0]}
        trajs = [make_trajectory(t, rewards[t.prompt["source"]][i // 2]) for i, t in enumerate(tasks)]
        await layer.complete(store_and_ref(w, trajs))
        res = (await layer.state())["eval"][0]
        assert res["eval_accuracy"] == pytest.approx(0.75)
        assert res["eval_accuracy_by_source"] == {"a": pytest.approx(1.0), "b": pytest.approx(0.5)}

    asyncio.run(go())


def test_one_source_changes_nothing(tmp_path):
    """A plain workload is one source ``""``: the same prompt order, no per-source keys in the
    metrics; a mix with one source draws its prompts in the same order too."""
    plain = make_layer(tmp_path, workload_name="math", params=ADD)
    single = make_layer(tmp_path, params={"sources": {"a": {"workload": "math", "params": ADD}}})

    async def go():
        l_plain, l_single = {}, {}
        b_plain = await serve(plain, 3, leased=l_plain)
        await serve(single, 3, leased=l_single)
        assert "consumed_by_source" not in b_plain[0].metrics
        q_plain = [p["question"] for p in l_plain.values()]
        q_single = [p["question"] for p in l_single.values()]
        n = min(len(q_plain), len(q_single))
        assert n >= 12 * 4 and q_plain[:n] == q_single[:n]
        assert plain.mixer.weights == {"": 1.0} and plain.state_dict()["order"].keys() == {""}
        assert all(v == 0.0 for v in plain.mixer.credit["p"].values())

    asyncio.run(go())


def test_a_step_line_counts_what_was_trained_on_not_the_batch_fetched_ahead(tmp_path):
    """A trainer fetches its next batch before it reports the version trained on the last (as
    the real one does): the step line's cumulative ``consumed``, ``consumed_by_source`` and
    ``staleness_hist`` count the batches trained on up to that step, not the one in hand."""
    layer = make_layer(tmp_path, params={"sources": sources(a=3, b=1)})

    async def go():
        writer, stop = layer.store.writer("n0"), asyncio.Event()

        async def node():
            while not stop.is_set():
                tasks = await layer.lease("n0", 8)
                trajs = [make_trajectory(t, mixed_reward(t), version=layer.versions["p"]) for t in tasks]
                if trajs:
                    await layer.complete(store_and_ref(writer, trajs))
                await asyncio.sleep(0.001 if tasks else 0.01)

        rolling = asyncio.create_task(node())
        await layer.next_batch("p", 0, timeout=10)
        for v in range(1, 4):
            await layer.next_batch("p", v, timeout=10)  # the next batch in hand, then v reported
            await layer.published("p", v, {"loss": 0.0})
        stop.set()
        await rolling

    asyncio.run(go())
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {x["step"]: x for x in lines if "consumed" in x}
    for v in (1, 2, 3):
        assert steps[v]["consumed"] == 16 * v, steps[v]
        assert steps[v]["consumed_by_source"] == {"a": 12 * v, "b": 4 * v}
        assert sum(steps[v]["staleness_hist"].values()) == 16 * v
    assert layer.counts["p"]["consumed"] == 48 and layer.mixer.consumed_by_source("p") == {"a": 36, "b": 12}
