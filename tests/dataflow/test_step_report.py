"""The per-step report of the data layer (one metrics line per policy and trainer step) and
the save/restore of the dataflow state with the run."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from astraflow.dataflow.config import DataflowConfig, DropZeroAdvantageRule, FilterSolvedRule, GresoRule, UserCurator

from astraflow.workloads.config import EvalConfig, WorkloadConfig
from astraflow.dataflow import rules as R
from astraflow.dataflow.layer import DataLayer

from tests.dataflow.helpers import make_trajectory, store_and_ref


@R.CURATORS.register("odd_prompts_skipped_test")
class SkipOdd(R.AcceptAll):
    def accept(self, prompt_key, payload):
        return int(prompt_key[1:]) % 2 == 0


def make_layer(tmp_path, state_path=None, **df):
    return DataLayer(
        dataflow=DataflowConfig(batch_size=8, **df),
        workload=WorkloadConfig(name="math", params={"digits": 1, "num_test": 10}, group_size=4,
                                eval=EvalConfig(every=0, num_prompts=2)),
        policies=["p"], store_url=f"memory://{uuid.uuid4().hex}",
        metrics_path=str(tmp_path / "metrics.jsonl"), max_steps=10, state_path=state_path,
    )


def alternating(t):
    return float(int(t.task_id.split("/")[1]) % 2)


def test_every_step_line_reports_counts_staleness_wait_and_rollout_cost(tmp_path):
    layer = make_layer(tmp_path, group_filter=DropZeroAdvantageRule(),
                       curator=UserCurator(type="odd_prompts_skipped_test"), replay_ratio=0.5,
                       max_staleness=1, prefetch_groups=0)

    async def roll(n, reward_of, version=0):
        tasks = await layer.lease("n0", n)
        assert len(tasks) == n
        w = layer.store.writer(f"n0-{uuid.uuid4().hex[:6]}")
        await layer.complete(store_and_ref(w, [make_trajectory(t, reward_of(t), version=version) for t in tasks]))

    async def go():
        def one_group_solved(t):  # the first group has all-equal rewards: filtered
            return 1.0 if t.group_id == "g0000001" else alternating(t)

        await roll(8, one_group_solved)
        await roll(4, alternating)
        b1 = await layer.next_batch("p", 0, timeout=5)
        assert len(b1) == 8
        await layer.published("p", 1, {"loss": 0.5})
        # a group generated at v0 is too stale for a trainer at v2 (bound 1): dropped
        await roll(4, alternating, version=0)
        await layer.published("p", 2, {})
        await roll(4, alternating, version=2)
        assert await layer.ready("p", 2) == 4  # the v0 group leaves the buffer as stale: room for one more
        await roll(4, alternating, version=2)
        b3 = await layer.next_batch("p", 2, timeout=5)
        assert sum(i.replayed for i in b3.items) == 0  # all consumed rows are v0: past the bound for replay too
        await layer.published("p", 3, {})

    asyncio.run(go())
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {x["step"]: x for x in lines if x.get("policy") == "p" and "accepted" in x}
    assert set(steps) == {1, 2, 3}
    one, three = steps[1], steps[3]
    assert one["loss"] == 0.5 and one["dataflow"]["group_filter"] == "drop_zero_advantage"
    assert (one["accepted"], one["filtered"], one["stale_dropped"], one["replayed"], one["consumed"]) == (8, 4, 0, 0, 8)
    assert one["staleness_hist"] == {"0": 8} and one["data_staleness_hist"] == {"0": 8}
    assert one["rollouts_generated"] == 12 and one["rollouts_per_consumed"] == pytest.approx(1.5)
    assert one["curator_skipped"] > 0  # odd prompts never reached a RaaS node
    assert one["trainer_wait_s"] >= 0 and "data_wait_s" in one
    assert (three["accepted"], three["filtered"], three["stale_dropped"], three["replayed"], three["consumed"]) == (20, 4, 4, 0, 16)
    assert three["staleness_hist"] == {"0": 16}
    assert three["rollouts_generated"] == 24 and three["rollouts_per_consumed"] == pytest.approx(24 / 16)
    assert three["trainer_wait_s"] >= one["trainer_wait_s"]


def test_dataflow_state_is_saved_at_publish_and_restored_with_random_streams(tmp_path):
    state = tmp_path / "dataflow_state.json"
    spec = dict(curator=GresoRule(params={"floor": 0.2}))
    layer = make_layer(tmp_path, state_path=str(state), **spec)

    async def go():
        tasks = await layer.lease("n0", 8)
        w = layer.store.writer("n0")
        await layer.complete(store_and_ref(w, [make_trajectory(t, 1.0) for t in tasks]))
        await layer.published("p", 1, {})

    asyncio.run(go())
    saved = json.loads(state.read_text())
    assert saved["policy_types"]["curator"] == "greso" and "rng_state" in saved["curator"]
    assert saved["curator"]["streak"]  # zero-variance groups were observed
    resumed = make_layer(tmp_path, state_path=str(state), **spec)
    assert resumed.state_dict() == layer.state_dict()
    keys = [f"p{i}" for i in range(100)]
    for k in list(layer.curator.streak):
        for c in (layer.curator, resumed.curator):
            c.observe(k, [1.0] * 4)
    assert [resumed.curator.accept(k, {}) for k in keys * 3] == [layer.curator.accept(k, {}) for k in keys * 3]
    assert [resumed.mixer.next_prompt() for _ in range(150)] == [layer.mixer.next_prompt() for _ in range(150)]
    # a changed curator type starts fresh instead of loading foreign state
    other = make_layer(tmp_path, state_path=str(state), curator=FilterSolvedRule())
    assert other.curator.success == {} and other.versions["p"] == 1
