"""What crosses a Dask actor call often must arrive whole and packed: a batch (once per trainer
step), the lists of tasks and trajectory refs (every lease and complete)."""

import pickle
import threading
import time

import numpy as np
import pytest
from distributed.protocol import dumps, loads, to_serialize

from astraflow.batches import Batch, BatchItem
from astraflow.contracts import RolloutTask, Sequence, SequenceSummary, TrajectoryRef
from astraflow import transport
from astraflow.transport import Link, Packed, PackedDict, call_sync
from storage.trajectories import EntryRef


def _batch(n: int) -> Batch:
    rng = np.random.default_rng(0)
    items = []
    for i in range(n):
        n_prompt, n_gen = 3 + i % 4, 1 + i % 5  # sequences of different lengths
        seq = Sequence.build(
            tokens=rng.integers(0, 100, n_prompt + n_gen),
            loss_mask=np.r_[np.zeros(n_prompt, bool), np.ones(n_gen, bool)],
            logprobs=np.r_[np.zeros(n_prompt), -rng.random(n_gen)],
            policy_ids=np.r_[np.full(n_prompt, -1), np.full(n_gen, i % 2)],
            versions=np.r_[np.full(n_prompt, -1), np.full(n_gen, 7 + i % 3)],
            reward=float(i % 2), rewards={"correct": float(i % 2)} if i % 3 else {},
            finish_reason="length" if i % 4 == 0 else "stop",
        )
        own = seq.loss_mask & (seq.policy_ids == 0)  # the batch's policy's tokens only
        items.append(BatchItem(sequence=seq, loss_mask=own, group_mean=0.25 * (i % 4), group_std=0.5,
                               group_size=8, staleness=i % 3, task_id=f"g{i // 8}/{i % 8}",
                               replayed=i == 5))
    return Batch(policy="solver", version=9, items=tuple(items), metrics={"stale_dropped": 3})


def _same(a: Batch, b: Batch) -> None:
    assert (b.policy, b.version, dict(b.metrics), len(b)) == (a.policy, a.version, dict(a.metrics), len(a))
    for x, y in zip(a.items, b.items):
        assert y.sequence == x.sequence
        assert y.sequence.tokens.dtype == x.sequence.tokens.dtype
        assert np.array_equal(y.loss_mask, x.loss_mask) and y.loss_mask.dtype == bool
        assert (y.group_mean, y.group_std, y.group_size, y.staleness, y.task_id, y.replayed) == \
               (x.group_mean, x.group_std, x.group_size, x.staleness, x.task_id, x.replayed)
        assert y.advantage == x.advantage


def test_batch_round_trips_through_pickle_and_dask_in_a_few_frames():
    batch = _batch(40)
    _same(batch, pickle.loads(pickle.dumps(batch, protocol=5)))
    frames = dumps({"result": batch})
    # one frame per packed column, not several per item (40 items would be ~200 frames)
    assert len(frames) < 20
    _same(batch, loads(frames)["result"])


def test_the_batch_wire_formats_carry_every_field_of_their_records():
    """The reducers list the fields by hand: a field added to a record must be carried, not
    arrive as its class default."""
    from dataclasses import fields

    from astraflow.batches import BatchRefs, RowRef

    back = pickle.loads(pickle.dumps(_batch(3)))
    assert set(vars(back.items[0])) == {f.name for f in fields(BatchItem)}
    assert set(vars(back.items[0].sequence)) == {f.name for f in fields(Sequence)}
    row = RowRef(ref=EntryRef("s", 1), task_id="g/0", reward=1.0, group_mean=0.5, group_std=0.5, group_size=2,
                 staleness=1, replayed=True)
    refs = pickle.loads(pickle.dumps(BatchRefs(policy="p", version=3, items=(row,), metrics={})))
    assert set(vars(refs.items[0])) == {f.name for f in fields(RowRef)}
    assert [getattr(refs.items[0], f.name) for f in fields(RowRef)] == [getattr(row, f.name) for f in fields(RowRef)]


def test_empty_batch_round_trips():
    empty = Batch(policy="p", version=0, items=())
    back = loads(dumps({"result": empty}))["result"]
    assert len(back) == 0 and back.policy == "p"


def _refs(n: int) -> list[TrajectoryRef]:
    return [TrajectoryRef(task_id=f"g{i // 8}/{i % 8}", group_id=f"g{i // 8}", kind="train", attempt=0, node="n0",
                          sequences=tuple(SequenceSummary(ref=EntryRef("n0/seg-1", 2 * i + j), reward=float(j),
                                                          policy_tokens={"solver": (3, 7)}, num_tokens=12,
                                                          finish_reason="stop") for j in range(2)),
                          score=1.0) for i in range(n)]


def test_packed_list_crosses_dask_in_one_frame_and_arrives_as_a_list():
    refs = _refs(40)
    # what an actor call sends: each argument wrapped by ``to_serialize``
    plain = dumps({"args": [to_serialize(list(refs))]})
    packed = dumps({"args": [to_serialize(Packed(refs))]})
    assert len(plain) > 40 and len(packed) <= 4  # a frame per record against one for the list
    back = loads(packed)["args"][0]
    assert isinstance(back, list) and back == refs
    tasks = Packed(RolloutTask(task_id=f"g/{i}", group_id="g", policies=("a", "b"), workflow="w",
                               prompt={"question": "1+2=", "answer": 3}) for i in range(3))
    assert loads(dumps({"result": to_serialize(tasks)}))["result"] == list(tasks)


def test_packed_dict_crosses_dask_in_one_frame_and_arrives_as_a_plain_dict():
    # what a gathered lease answers: node -> its tasks (most of them none)
    answer = {f"w0.n{i}": Packed(RolloutTask(task_id=f"g{i}/{j}", group_id=f"g{i}", policies=("a",), workflow="w",
                                             prompt={"question": "1+2=", "answer": 3}) for j in range(i % 2))
              for i in range(60)}
    plain = dumps({"result": to_serialize(answer)})
    packed = dumps({"result": to_serialize(PackedDict(answer))})
    assert len(plain) > 60 and len(packed) <= 4  # a frame per value against one for the dict
    back = loads(packed)["result"]
    assert type(back) is dict and back == answer and type(back["w0.n1"]) is Packed
    # what is kept of it pickles as a plain dict too (a snapshot's allowlist knows no PackedDict)
    assert type(pickle.loads(pickle.dumps(PackedDict(a=1)))) is dict


def test_call_sends_plain_lists_packed():
    seen = {}

    class Future:
        def result(self, timeout):
            return None

    def method(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return Future()

    call_sync(method, [1, 2], "x", (3,), refs=[4], n=5, stats={"a": 1})
    assert type(seen["args"][0]) is Packed and seen["args"][0] == [1, 2]
    assert seen["args"][1:] == ("x", (3,)) and type(seen["kwargs"]["refs"]) is Packed and seen["kwargs"]["n"] == 5
    assert type(seen["kwargs"]["stats"]) is PackedDict and seen["kwargs"]["stats"] == {"a": 1}


class _Pending:
    """An actor call's future that never answers (a call pending on an actor whose worker died)."""

    def result(self, timeout):
        time.sleep(timeout)
        raise TimeoutError(f"timed out after {timeout} s.")

    def done(self):
        return False


class _Answered:
    def __init__(self, value):
        self.value = value

    def result(self, timeout):
        return self.value

    def done(self):
        return True


class _Handle:
    def __init__(self, future):
        self.future, self.calls = future, 0

    def lease(self, *args):
        self.calls += 1
        return self.future


class _LostWhileWaiting:
    """A future on an actor whose worker died: it never answers, and the orchestrator swaps the
    link to the re-placed actor while the first slice of the wait runs. Looking at it again after
    the swap is the call waiting out its deadline on an actor that will never answer."""

    def __init__(self, link_to_swap, replacement):
        self.link_to_swap, self.replacement, self.slices = link_to_swap, replacement, []

    def result(self, timeout):
        self.slices.append(timeout)
        assert len(self.slices) == 1, "awaited again on the lost actor after its replacement was set"
        self.link_to_swap[0].set(self.replacement)
        raise TimeoutError(f"timed out after {timeout} s.")

    def done(self):
        return False


def test_a_call_pending_on_a_lost_actor_is_made_again_on_its_replacement(monkeypatch):
    """The data layer's worker dies while a node's call waits on it; the orchestrator swaps the
    link to the re-placed data layer: the call is made again there at once (after the slice that
    was running), instead of waiting out its deadline on an actor that will never answer."""
    monkeypatch.setattr(transport._LinkCall, "SLICE_S", 0.05)
    new, link_box = _Handle(_Answered(["t1"])), []
    lost = _LostWhileWaiting(link_box, new)
    old = _Handle(lost)
    link_box.append(Link(old, "the data layer"))
    assert call_sync(link_box[0].lease, "n0", 4, timeout=30) == ["t1"]
    assert lost.slices == [0.05] and old.calls == 1 and new.calls == 1


class _Clock:
    """`time` for `astraflow.transport` whose clock moves only when a future waits on it."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class _PendingOnClock:
    """A future that never answers, waiting on `_Clock` (each wait recorded) instead of sleeping."""

    def __init__(self, clock):
        self.clock, self.waits = clock, []

    def result(self, timeout):
        self.waits.append(timeout)
        self.clock.sleep(timeout)
        raise TimeoutError(f"timed out after {timeout} s.")

    def done(self):
        return False


def test_a_call_through_a_link_that_is_not_replaced_still_times_out(monkeypatch):
    """Its own timeout, awaited in slices: not the 30 s of a lease call, and not given up early."""
    monkeypatch.setattr(transport._LinkCall, "SLICE_S", 0.05)
    clock = _Clock()
    monkeypatch.setattr(transport, "time", clock)
    pending = _PendingOnClock(clock)
    link = Link(_Handle(pending), "the data layer")
    with pytest.raises(TimeoutError):
        call_sync(link.lease, "n0", 4, timeout=0.4)
    assert max(pending.waits) <= 0.05 and sum(pending.waits) == pytest.approx(0.4, abs=0.002)


def test_a_call_to_an_actor_known_lost_waits_past_its_deadline_for_the_replacement(monkeypatch):
    """The orchestrator said the data layer is lost and is being re-placed (a new Slurm job may
    take long to start): a call whose deadline passes meanwhile waits for the new handle and is
    made again there, instead of failing the node's loop with a timeout."""
    monkeypatch.setattr(transport._LinkCall, "SLICE_S", 0.05)
    old, new = _Handle(_Pending()), _Handle(_Answered(["t1"]))
    link = Link(old, "the data layer", reconnect_s=30)
    link.expect_new()
    threading.Timer(1.0, link.set, args=(new,)).start()
    t0 = time.monotonic()
    assert call_sync(link.lease, "n0", 4, timeout=0.3) == ["t1"]
    assert time.monotonic() - t0 >= 0.9 and old.calls == 1 and new.calls == 1
    # the new handle is not known lost: its calls time out as usual
    newer = Link(_Handle(_Pending()), "the data layer", reconnect_s=30)
    newer.expect_new()
    newer.set(_Handle(_Pending()))
    with pytest.raises(TimeoutError):
        call_sync(newer.lease, "n0", 4, timeout=0.3)


def test_a_lost_actor_that_is_not_replaced_in_time_fails_the_call(monkeypatch):
    monkeypatch.setattr(transport._LinkCall, "SLICE_S", 0.05)
    link = Link(_Handle(_Pending()), "the data layer", reconnect_s=0.3)
    link.expect_new()
    with pytest.raises(TimeoutError, match="not re-placed within"):
        call_sync(link.lease, "n0", 4, timeout=0.2)


def test_long_deadlines_awaited_on_a_loop_share_a_timer_per_tick_and_still_pass():
    """Calls with long deadlines do not each put a timer in the loop's heap; an answered call
    leaves nothing behind, and a deadline passes at most one tick late."""
    import asyncio

    from astraflow import pending as pd

    async def scenario():
        loop = asyncio.get_running_loop()
        answered = [pd.Pending() for _ in range(200)]
        waits = [asyncio.ensure_future(p.wait_async(pd.COARSE_AFTER_S + 30)) for p in answered]
        await asyncio.sleep(0)
        timers = len(loop._scheduled)
        pd.settle_all((p, i) for i, p in enumerate(answered))
        assert await asyncio.gather(*waits) == list(range(200))
        assert timers <= 2  # one tick for all (two if they straddled a tick's edge)
        assert not any(pd._deadlines(loop).due.values())  # answered calls are not kept
        unanswered = pd.Pending()
        t0 = loop.time()
        with pytest.raises(TimeoutError, match="no answer"):
            await unanswered.wait_async(pd.COARSE_AFTER_S)
        late = loop.time() - t0 - pd.COARSE_AFTER_S
        assert -0.01 <= late <= pd.TICK_S + 0.2

    asyncio.run(scenario())
