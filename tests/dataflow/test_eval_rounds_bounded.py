"""Finished evaluation rounds do not pile up in the data layer: a written round leaves its record
(the run's eval history) and its version, not its per-prompt rewards, sources and statistics, so
the layer's memory and its snapshot stay flat however many rounds a long run evaluates; a resume
neither evaluates a finished version again nor loses the history the status and summary report."""

from __future__ import annotations

import json
import pickle
import sys
from collections import deque

from astraflow.contracts import TrajectoryRef
from astraflow.dataflow import changelog, changes, durable
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.evals import EvalRound, EvalRounds
from astraflow.dataflow.layer import DataLayer
from astraflow.workloads.config import EvalConfig, WorkloadConfig
from tests.dataflow.helpers import make_trajectory, store_and_ref
from tests.dataflow.test_changelog import same
from tests.dataflow.test_data_layer import Node, run
from tests.dataflow.test_durable import Paths as DurablePaths

PROMPTS = 12
#: what the rounds held and the snapshot's rounds may grow by from few to many finished rounds
FLAT_BYTES = 4 << 10
#: what one finished round may add to the whole snapshot: its record, whatever its prompts
RECORD_BYTES = 1 << 10


class Paths(DurablePaths):
    """The durable data layer's files, as in ``test_durable``, with evaluation rounds of ``PROMPTS``."""

    def layer(self, max_steps: int = 1000) -> DataLayer:
        return DataLayer(
            dataflow=DataflowConfig(batch_size=8),
            workload=WorkloadConfig(name="math", params={"digits": 1, "num_test": PROMPTS}, group_size=4,
                                    eval=EvalConfig(every=1, num_prompts=PROMPTS)),
            policies=["p"], store_url=self.url, metrics_path=str(self.metrics), max_steps=max_steps,
            state_path=str(self.state), snapshot_path=str(self.snapshot), journal_path=str(self.journal),
        )

    def steps(self) -> list[int]:
        return [json.loads(x)["step"] for x in self.metrics.read_text().splitlines() if '"eval_prompts"' in x]


def _half_right(task) -> float:
    return float(int(task.group_id.rpartition("-")[2]) % 2)


async def _evaluate(layer: DataLayer, node: Node, versions) -> None:
    """Rounds at ``versions``, each run to its end (evaluation tasks are leased first)."""
    for v in versions:
        await layer.start_eval(v)
        while not await layer.eval_done(v):
            assert await node.roll(PROMPTS, reward_of=_half_right)


def _deep_size(obj, seen: set[int]) -> int:
    if id(obj) in seen or callable(obj):
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        size += sum(_deep_size(x, seen) for x in obj)
    elif hasattr(obj, "__dict__"):
        size += _deep_size(vars(obj), seen)
    return size


def _held_bytes(ev: EvalRounds) -> int:
    """Memory of the evaluations but for their prompts and their records (the eval history)."""
    seen = {id(ev.payloads), id(ev.sources), id(ev.results)}
    return sum(_deep_size(v, seen) for k, v in vars(ev).items() if k not in ("payloads", "sources"))


def _snapshot(paths: Paths) -> tuple[int, int]:
    """Bytes of the saved state's rounds, and of the saved base (the layer is closed)."""
    state = durable.load(paths.snapshot)
    return len(pickle.dumps(state["evals"]["rounds"])), paths.snapshot.stat().st_size


def test_memory_and_snapshot_stay_flat_with_finished_rounds(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer()
    node = Node(layer)
    run(_evaluate(layer, node, range(20)))
    held_few = _held_bytes(layer.evals)
    run(layer.close())
    rounds_few, base_few = _snapshot(paths)
    records_few = len(pickle.dumps(durable.load(paths.snapshot)["evals"]["results"]))

    layer = paths.layer()  # its base is the whole state at the start
    node.layer = layer
    run(_evaluate(layer, node, range(20, 200)))
    held_many = _held_bytes(layer.evals)
    run(layer.close())
    layer = paths.layer()  # the base written at the start: what a compaction would write
    run(layer.close())
    rounds_many, base_many = _snapshot(paths)
    records_many = len(pickle.dumps(durable.load(paths.snapshot)["evals"]["results"]))

    assert sorted(paths.steps()) == list(range(200))
    assert held_many - held_few < FLAT_BYTES, (held_few, held_many)
    assert rounds_many - rounds_few < FLAT_BYTES, (rounds_few, rounds_many)
    # what the base grows by is the records, each the same size whatever the round's prompts
    assert records_many - records_few < 180 * RECORD_BYTES
    assert base_many - base_few < 180 * RECORD_BYTES, (base_few, base_many)


def test_a_resume_after_many_rounds_evaluates_no_finished_version_again_and_keeps_the_history(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer()
    node = Node(layer)
    run(_evaluate(layer, node, range(60)))
    history = run(layer.state())["eval"]
    assert run(layer.state(5))["eval"] == history[-5:] and run(layer.state(0))["eval"] == []  # a tick's read
    run(layer.finish(completed=False))
    run(layer.close())

    resumed = paths.layer()
    node.layer = resumed
    assert resumed.restored is not None and not resumed.evals.rounds
    assert not resumed.leases.eval_pending and resumed.evals.initial_done()

    async def after():
        await resumed.resume_evaluation()
        for v in (0, 17, 59):
            await resumed.start_eval(v)  # finished: nothing to run
        assert not resumed.leases.eval_pending
        assert all([await resumed.eval_done(v) for v in range(60)])
        await _evaluate(resumed, node, [60])
        return await resumed.state()

    state = run(after())
    assert state["eval"] == history + [state["eval"][-1]] and state["eval"][-1]["step"] == 60
    assert [e["step"] for e in state["eval"]] == list(range(61))
    assert sorted(paths.steps()) == list(range(61))  # each version recorded once
    assert not resumed.evals.rounds
    run(resumed.close())


def test_the_final_round_is_done_without_being_held_and_after_a_resume(tmp_path):
    """The orchestrator ends the run once ``eval_done(run.max_steps)``."""
    paths = Paths(tmp_path)
    final = 30
    layer = paths.layer(max_steps=final)
    node = Node(layer)
    run(_evaluate(layer, node, range(final + 1)))
    assert run(layer.eval_done(final)) and not run(layer.eval_done(final + 1))
    assert not layer.evals.rounds
    run(layer.finish())
    run(layer.close())

    resumed = paths.layer(max_steps=final)
    assert run(resumed.eval_done(final)) and not resumed.evals.rounds
    run(resumed.start_eval(final))
    assert not resumed.leases.eval_pending and run(resumed.eval_done(final))
    run(resumed.close())


def test_a_snapshot_that_holds_finished_rounds_is_read_and_rewritten_without_them(tmp_path):
    """An earlier AstraFlow kept every finished round in its snapshot: such a snapshot restores,
    its finished versions count as evaluated, and the new base leaves them out."""
    paths = Paths(tmp_path)
    layer = paths.layer()
    run(_evaluate(layer, Node(layer), range(5)))
    run(layer.close())
    layer = paths.layer()  # a fresh base, its log empty
    run(layer.close())
    base = changelog._loads(paths.snapshot.read_bytes(), paths.snapshot)
    results = [changelog._loads(b, paths.snapshot) for _, b in sorted(base["entries"]["result"].items())]
    for r in results:
        v = r["step"]
        old = EvalRound(version=v, policy="p", k=1, rewards={f"eval-v{v}-{i}": [1.0] for i in range(PROMPTS)},
                        result=r, written=True, versions_used=[v] * PROMPTS)
        base["entries"]["round"][v] = pickle.dumps(old)
    paths.snapshot.write_bytes(pickle.dumps(base))
    assert len(durable.load(paths.snapshot)["evals"]["rounds"]) == 5

    resumed = paths.layer()
    assert not resumed.evals.rounds and not resumed.leases.eval_pending
    assert all(run(resumed.eval_done(v)) for v in range(5)) and resumed.evals.initial_done()
    assert [e["step"] for e in run(resumed.state())["eval"]] == list(range(5))
    assert not durable.load(paths.snapshot)["evals"]["rounds"]  # the base written at the start
    run(resumed.close())


def test_the_change_log_holds_a_round_until_it_is_written(tmp_path):
    """A round finished behind an earlier one is saved with its record alone; once written, its
    entry leaves the log and the base (the record stays); the saved state is the live one."""
    paths = Paths(tmp_path)
    layer = paths.layer()  # its round at v0 is open
    writer = layer.store.writer("n")

    def rounds_saved() -> dict:
        return {key: changes.entry(layer, kind, key) for kind, key in changes.all_keys(layer) if kind == "round"}

    async def complete(tasks) -> None:
        await layer.complete(store_and_ref(writer, [make_trajectory(t, _half_right(t), node="n") for t in tasks]))
        await layer.durability.commit()

    async def go():
        await layer.start_eval(2)
        tasks = [t for t in await layer.lease("n", 2 * PROMPTS) if t.kind == "eval"]
        await complete([t for t in tasks if t.min_version == 2])
        held = layer.evals.rounds[2]
        assert held.result is not None and not held.rewards and not layer.evals.results
        assert rounds_saved() == {0: layer.evals.rounds[0], 2: held}
        same(paths, layer)
        await complete([t for t in tasks if t.min_version == 0])
        assert not layer.evals.rounds and not rounds_saved() and [r["step"] for r in layer.evals.results] == [0, 2]
        same(paths, layer)
        await layer.close()

    run(go())
    run(paths.layer().close())  # a base written afresh
    base = changelog._loads(paths.snapshot.read_bytes(), paths.snapshot)
    assert not base["entries"]["round"]
    state = durable.load(paths.snapshot)
    assert not state["evals"]["rounds"] and [r["step"] for r in state["evals"]["results"]] == [0, 2]


def _finish(ev: EvalRounds, tasks, score: float = 1.0) -> None:
    for t in tasks:
        ev.record(t, TrajectoryRef(t.task_id, t.group_id, "eval", 0, "n", (), score=score))


def test_a_round_held_back_keeps_only_its_record_and_none_is_held_once_written():
    written: list[dict] = []
    ev = EvalRounds([{"q": i, "difficulty": "1"} for i in range(3)], ["a", "b", "a"], k=1, policies=["p"],
                    workflow="w", by_source=True, started=0.0, write=written.append)
    t0, t2 = ev.start(0), ev.start(2)
    _finish(ev, t2)
    held = ev.rounds[2]  # finished first: waits for v0
    assert held.result is not None and not held.rewards and not held.sources and not held.difficulty
    assert held.result["eval_by_difficulty"]["1"]["prompts"] == 3 and not ev.done(2)
    _finish(ev, t0, 0.0)
    assert [r["step"] for r in written] == [0, 2] and ev.done(0) and ev.done(2)
    assert not ev.rounds and ev.initial_done() and ev.start(0) == [] and ev.start(2) == []
    t5 = ev.start(5)
    assert ev.initial_done() and len(t5) == 3 and all("eval_set" not in t.prompt for t in t5)
