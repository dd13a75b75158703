"""Several policies in one run: routing by per-token policy id, per-policy group statistics,
independence, lockstep, and a workflow written only here that needs no change elsewhere."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref

import numpy as np
import pytest

from astraflow.dataflow.config import DataflowConfig

from astraflow.workloads.config import EvalConfig, WorkloadConfig
from astraflow.contracts import Provenance, RolloutTask, Sequence, Trajectory
from astraflow.dataflow.layer import BatchTimeout, DataLayer
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.workflows import WORKFLOWS
from astraflow.workloads.base import make_workload
from astraflow.rollout.workflows import WorkflowBase, turn_sequence
from astraflow.training.rows import BatchRows

from tests.dataflow.helpers import store_and_ref


def layer2(tmp_path, **df) -> DataLayer:
    return DataLayer(
        dataflow=DataflowConfig(batch_size=4, prefetch_groups=0, **df),
        workload=WorkloadConfig(name="math", workflow="solver_verifier", params={"digits": 1},
                                group_size=2, eval=EvalConfig(every=0)),
        policies=["solver", "verifier"],
        store_url=f"memory://{uuid.uuid4().hex}",
        metrics_path=None,
        max_steps=10,
    )


def two_policy_trajectory(task: RolloutTask, solver_reward: float, verifier_reward: float,
                          version=(0, 0)) -> Trajectory:
    """seq 0: solver turn; seq 1: one flattened sequence with tokens of both policies."""
    s0 = Sequence.build(tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1, -1],
                        policy_ids=[-1, -1, 0, 0], versions=[-1, -1, version[0], version[0]],
                        reward=solver_reward)
    s1 = Sequence.build(tokens=[5, 6, 7, 8, 9], loss_mask=[0, 1, 0, 1, 1], logprobs=[0, -1, 0, -1, -1],
                        policy_ids=[-1, 0, -1, 1, 1], versions=[-1, version[0], -1, version[1], version[1]],
                        reward=verifier_reward)
    return Trajectory(task.task_id, task.group_id, task.policies, task.workflow, task.kind, task.attempt,
                      (s0, s1), Provenance(node="n"))


#: one segment writer per data layer; weak keys, so a later layer that reuses a collected
#: layer's id() never gets a writer into the old layer's store
_WRITERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


async def _fill(layer, rewards, version=(0, 0)):
    """Complete every leasable task, cycling through ``rewards``."""
    w = _WRITERS.setdefault(layer, layer.store.writer("n"))
    tasks = await layer.lease("n", 100)
    trajs = [two_policy_trajectory(t, *rewards[i % len(rewards)], version=version) for i, t in enumerate(tasks)]
    await layer.complete(store_and_ref(w, trajs))


def test_routing_masks_and_per_policy_group_stats(tmp_path):
    layer = layer2(tmp_path)

    async def go():
        # 2 groups of 2 episodes; solver rewards (1,0), verifier rewards (1,1)/(0,1)
        await _fill(layer, [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 1.0)])
        rows = BatchRows(layer.store.url)  # the trainers' side: the rows of the batches served
        sb = rows.batch(await layer.next_batch("solver", 0, timeout=5))
        vb = rows.batch(await layer.next_batch("verifier", 0, timeout=5))
        # the solver generated tokens in both sequences of every episode -> 8 candidates, 4 taken
        assert len(sb) == 4 and len(vb) == 4
        for item in sb.items:
            pid = item.sequence.policy_ids
            assert np.array_equal(item.loss_mask, item.sequence.loss_mask & (pid == 0))
            assert item.group_size == 4  # 2 episodes x 2 solver-bearing sequences
        for item in vb.items:
            assert np.array_equal(item.loss_mask, item.sequence.loss_mask & (item.sequence.policy_ids == 1))
            assert item.loss_mask.sum() == 2
        # verifier groups: rewards {1,1} (std 0) and {0,1} (mean .5)
        stats = sorted({(round(i.group_mean, 3), round(i.group_std, 3)) for i in vb.items})
        assert stats == [(0.5, 0.5), (1.0, 0.0)]

    asyncio.run(go())


def test_stalled_policy_does_not_stop_the_other(tmp_path):
    layer = layer2(tmp_path)

    async def go():
        # the verifier's trainer never asks; the solver keeps getting batches for many steps
        for step in range(8):
            await _fill(layer, [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 1.0)], version=(step, 0))
            b = await layer.next_batch("solver", step, timeout=5)
            assert len(b) == 4
            await layer.published("solver", step + 1, {})
        st = await layer.state()
        assert st["versions"] == {"solver": 8, "verifier": 0}
        assert st["counts"]["verifier"].get("overflow_dropped", 0) > 0  # capped, not unbounded

    asyncio.run(go())


def test_lockstep_is_a_version_barrier(tmp_path):
    layer = layer2(tmp_path, lockstep=True)

    async def go():
        await _fill(layer, [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 1.0)])
        await _fill(layer, [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 1.0)])
        await layer.next_batch("solver", 0, timeout=5)
        await layer.published("solver", 1, {})
        with pytest.raises(BatchTimeout):  # solver at v1 waits until the verifier reaches v1
            await layer.next_batch("solver", 1, timeout=0.3)
        await layer.next_batch("verifier", 0, timeout=5)
        await layer.published("verifier", 1, {})
        assert len(await layer.next_batch("solver", 1, timeout=5)) == 4

    asyncio.run(go())


def test_lockstep_trainers_both_advance_while_nodes_roll_out(tmp_path):
    """Lockstep with admission by version: the solver gets two sequences an episode, the
    verifier one, so each trainer's batch waits on groups the other's bound would refuse."""
    layer = layer2(tmp_path, lockstep=True, max_staleness=0)
    rewards = [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 1.0)]

    async def node(stop):
        while not stop.is_set():
            v = dict(layer.versions)
            tasks = await layer.lease("n", 8, wait=0.05, versions=v)
            trajs = [two_policy_trajectory(t, *rewards[i % 4], version=(v["solver"], v["verifier"]))
                     for i, t in enumerate(tasks)]
            if trajs:
                await layer.complete(store_and_ref(_WRITERS.setdefault(layer, layer.store.writer("n")), trajs))
            await asyncio.sleep(0.001)

    async def trainer(policy):
        for v in range(5):
            assert len(await layer.next_batch(policy, v, timeout=10)) == 4
            await layer.published(policy, v + 1, {})

    async def go():
        stop = asyncio.Event()
        rolling = asyncio.create_task(node(stop))
        try:
            await asyncio.gather(trainer("solver"), trainer("verifier"))
        finally:
            stop.set()
            await rolling
        assert layer.versions == {"solver": 5, "verifier": 5}

    asyncio.run(go())


# -- a new multi-policy workflow, defined only here ------------------------------------------


@WORKFLOWS.register("echo_critic_test")
class EchoCritic(WorkflowBase):
    """Policy 0 answers, policy 1 repeats the answer; both are rewarded by the workload."""

    num_policies = 2

    async def run_episode(self, engines, task):
        t0 = time.time()
        a, b = engines[task.policies[0]], engines[task.policies[1]]
        p = a.tokenizer.encode(self.workload.render_prompt(task.prompt))
        ga = await a.generate(p, self.sampling)
        r = self.workload.reward(a.tokenizer.decode(ga.tokens, skip_special_tokens=True), task.prompt)
        pb = list(p) + [int(t) for t in ga.tokens]
        gb = await b.generate(pb, self.sampling)
        return self.trajectory(task, [turn_sequence(p, ga, 0, r), turn_sequence(pb, gb, 1, r)], t0, 0.0)


def test_workflow_defined_in_a_test_runs_through_real_engines_and_data_layer(tiny_model, tmp_path):
    from astraflow.rollout.hf_engine import HFEngine

    layer = DataLayer(
        dataflow=DataflowConfig(batch_size=4, prefetch_groups=0),
        workload=WorkloadConfig(name="math", workflow="echo_critic_test", params={"digits": 1},
                                group_size=2, eval=EvalConfig(every=0)),
        policies=["a", "b"], store_url=f"memory://{uuid.uuid4().hex}", metrics_path=None, max_steps=3,
    )
    engines = {"a": HFEngine(str(tiny_model), version=0), "b": HFEngine(str(tiny_model), version=0)}
    wf = EchoCritic(workload=make_workload("math", {"digits": 1}, 0),
                    sampling=SamplingParams(max_new_tokens=3), node="n")

    async def go():
        tasks = await layer.lease("n", 4)
        trajs = await asyncio.gather(*(wf.run_episode(engines, t) for t in tasks))
        w = layer.store.writer("n")
        await layer.complete(store_and_ref(w, list(trajs)))
        for pol, idx in (("a", 0), ("b", 1)):
            batch = BatchRows(layer.store.url).batch(await layer.next_batch(pol, 0, timeout=5))
            assert len(batch) == 4
            assert all((i.sequence.policy_ids[i.loss_mask] == idx).all() for i in batch.items)

    asyncio.run(go())


def test_a_group_one_policy_settles_at_ingest_still_reaches_the_other(tmp_path):
    """Group of 2, one task fails for good: the survivor's sequence has tokens of both policies,
    one item each, too few for a group. The first policy settles its item at ingest (which
    would end the task) while the second's item is still to be routed: both are counted
    first, so both settle and the task ends once, as dropped."""
    layer = layer2(tmp_path, max_attempts=1)
    both = Sequence.build(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 0, 1], logprobs=[0, -1, 0, -1],
                          policy_ids=[-1, 0, -1, 1], versions=[-1, 0, -1, 0], reward=1.0)

    async def go():
        tasks = await layer.lease("n", 2)
        kept, failed = [t for t in tasks if t.group_id == tasks[0].group_id][:2]
        done = Trajectory(kept.task_id, kept.group_id, kept.policies, kept.workflow, kept.kind, kept.attempt,
                          (both,), Provenance(node="n"))
        await layer.complete(store_and_ref(layer.store.writer("n"), [done]))
        await layer.fail(failed.task_id, "engine")  # its last attempt: the group is done
        return kept

    kept = asyncio.run(go())
    assert layer.ledger.state_of(kept.task_id) == "dropped"
    assert not layer.buffers.routed_left and not layer.buffers.task_drop_reason
    for policy in ("solver", "verifier"):
        assert layer.buffers.counts[policy]["sequences_ingested"] == 1


def _two_policy_layer(tmp_path, url, keep=False, max_steps=10):
    return DataLayer(
        dataflow=DataflowConfig(batch_size=4, prefetch_groups=2),
        workload=WorkloadConfig(name="math", workflow="solver_verifier", params={"digits": 1, "num_test": 4},
                                group_size=2, eval=EvalConfig(every=2, num_prompts=2)),
        policies=["solver", "verifier"], store_url=url, metrics_path=str(tmp_path / "metrics.jsonl"),
        max_steps=max_steps, snapshot_path=str(tmp_path / "dataflow.snapshot"),
        journal_path=str(tmp_path / "ledger.jsonl"), keep_leases=keep)


@pytest.mark.parametrize("verifier_steps", [0, 1])
def test_a_resumed_evaluation_is_at_the_first_policys_version(tmp_path, verifier_steps):
    """Rounds measure the first policy (its nodes wait for its version): a resumed run's round
    is at that version, whatever the other policies' versions are."""
    url = str(tmp_path / "store")
    layer = _two_policy_layer(tmp_path, url)

    async def before():
        w = layer.store.writer("n")
        for v in range(3):  # solver reaches v3; the verifier stays at v0
            tasks = await layer.lease("n", 100)
            trajs = [two_policy_trajectory(t, float(i % 2), float(i % 2), version=(v, 0))
                     for i, t in enumerate(tasks)]
            await layer.complete(store_and_ref(w, trajs))
            await layer.next_batch("solver", v, timeout=5)
            await layer.published("solver", v + 1, {})
        for v in range(verifier_steps):
            await layer.next_batch("verifier", v, timeout=5)
            await layer.published("verifier", v + 1, {})
        await layer.close()

    asyncio.run(before())
    assert layer.versions == {"solver": 3, "verifier": verifier_steps}
    resumed = _two_policy_layer(tmp_path, url)  # a new incarnation of the run (keep_leases=False)

    async def after():
        await resumed.trainer_restarted("solver", 3, restart=False)
        await resumed.trainer_restarted("verifier", verifier_steps, restart=False)
        await resumed.resume_evaluation()

    asyncio.run(after())
    evals = [t for t in resumed.leases.tasks.values()
             if t.kind == "eval" and resumed.ledger.state_of(t.task_id) == "pending"]
    # the round measures the solver (policies[0]); its nodes load solver v3 before running it
    assert evals, "no resumed evaluation round was started"
    assert {t.min_version for t in evals} == {3}, sorted({t.min_version for t in evals})


def test_interrupted_multi_policy_run_can_finish_its_final_evaluation(tmp_path):
    """The solver (policies[0]) reached max_steps and its final round was cut short by an
    interrupt: the resume's round is at the solver's version, the one the orchestrator waits
    for (``eval_done(run.max_steps)``), not at the verifier's."""
    url = str(tmp_path / "store")

    layer = _two_policy_layer(tmp_path, url, max_steps=4)

    async def before():
        w = layer.store.writer("n")
        for v in range(4):
            tasks = [t for t in await layer.lease("n", 100) if t.kind == "train" or v < 3]
            trajs = [two_policy_trajectory(t, float(i % 2), float(i % 2), version=(v, 0))
                     for i, t in enumerate(tasks)]
            await layer.complete(store_and_ref(w, trajs))
            await layer.next_batch("solver", v, timeout=5)
            await layer.published("solver", v + 1, {})
        await layer.finish()  # interrupted (Ctrl-C): the final round of the solver is cut short
        await layer.close()

    asyncio.run(before())
    assert layer.versions == {"solver": 4, "verifier": 0} and not layer.evals.done(4)
    resumed = _two_policy_layer(tmp_path, url, max_steps=4)

    async def after():
        await resumed.trainer_restarted("solver", 4, restart=False)
        await resumed.trainer_restarted("verifier", 0, restart=False)
        await resumed.resume_evaluation()

    asyncio.run(after())
    # the orchestrator ends the run only once eval_done(run.max_steps): that round must exist
    assert 4 in resumed.evals.rounds, sorted(resumed.evals.rounds)


def test_a_batch_held_back_by_lockstep_says_so(tmp_path):
    """The buffer is full but lockstep waits for the other policy: the timeout says which."""
    layer = layer2(tmp_path, lockstep=True)

    async def go():
        for _ in range(2):
            await _fill(layer, [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 1.0)])
        await layer.next_batch("solver", 0, timeout=5)
        await layer.published("solver", 1, {})
        with pytest.raises(BatchTimeout) as err:
            await layer.next_batch("solver", 1, timeout=0.3)
        return str(err.value)

    msg = asyncio.run(go())
    assert "within 0.3s" in msg and "waiting for dataflow.lockstep: verifier at v0 (below v1)" in msg, msg


def test_each_policys_rollouts_per_consumed_counts_its_own_sequences(tmp_path):
    """Nothing filtered, nothing stale: the verifier trains on every sequence it gets (1); the
    solver gets two per episode and trains on half (2): each its own sequences over its own
    consumed, not every policy's."""
    import json

    layer = DataLayer(
        dataflow=DataflowConfig(batch_size=4, prefetch_groups=0, group_filter={"type": "keep_all"}),
        workload=WorkloadConfig(name="math", workflow="solver_verifier", params={"digits": 1},
                                group_size=2, eval=EvalConfig(every=0)),
        policies=["solver", "verifier"], store_url=f"memory://{uuid.uuid4().hex}",
        metrics_path=str(tmp_path / "metrics.jsonl"), max_steps=10)

    async def go():
        for v in range(2):
            await _fill(layer, [(1.0, 0.0), (0.0, 1.0)], version=(v, v))
            for p in ("solver", "verifier"):
                await layer.next_batch(p, v, timeout=5)
                await layer.published(p, v + 1, {})

    asyncio.run(go())
    layer.metrics.flush()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = {x["policy"]: x for x in lines if "rollouts_per_consumed" in x}
    assert set(last) == {"solver", "verifier"}
    assert last["verifier"]["rollouts_per_consumed"] == pytest.approx(1.0)
    assert last["solver"]["rollouts_per_consumed"] == pytest.approx(2.0)
    assert last["solver"]["rollouts_generated"] == last["verifier"]["rollouts_generated"] == 16  # run-wide
