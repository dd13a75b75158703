"""The Dask transport: how components call each other's actors and what crosses the wire.

Component loops run in their own thread (with their own asyncio loop) inside a worker and call
other actors through handles. A handle deserialised into an actor is not bound to the worker
when the call comes from such a thread (``get_worker()`` only works on Dask's own threads), so
``bind`` binds it once from the actor's method, and ``call`` turns a handle call into an
awaitable with a deadline.

Wire format: Dask serialises a plain ``list`` element by element (one pickle and one frame per
record), so list arguments and list results travel as one ``Packed``; a ``Batch`` travels as
one array per field instead of ~5 arrays per item, a ``BatchRefs`` as a few columns instead of
one record per row (``copyreg`` registrations below, so the records stay plain dataclasses);
a ``dict`` travels as one ``PackedDict``. Components import this module; it imports none of them.

Re-placed actors: a component holds the data layer through a ``Link``, a handle that the
orchestrator swaps (``Link.set``) when it re-places the data layer on another worker. A call
through it that finds the actor's worker lost waits for the new handle and is made again
there; the data layer's calls are safe to repeat (a repeated completion or commit is
recognised, see ``astraflow/dataflow/durable.py``). A ``Link`` sends the methods an actor serves
on its direct lane (``lane.py``) down that lane, and the rest through Dask.
"""

from __future__ import annotations

import asyncio
import copyreg
import logging
import threading
import time
from typing import Any

import numpy as np
from distributed import get_worker
from distributed.comm.core import CommClosedError

from astraflow import lane
from astraflow.batches import Batch, BatchItem, BatchRefs, RowRef
from astraflow.contracts import Sequence
from storage.trajectories import EntryRef


class Packed(list):
    """A list that crosses a Dask actor call as one object (one pickle, one frame); it arrives
    as a ``Packed``, which is a ``list``. ``call`` packs plain list arguments; actor methods
    that return a list of records return a ``Packed``."""

    def __reduce__(self):
        return (Packed, (list(self),))


class PackedDict(dict):
    """A dict that crosses a Dask actor call as one object: Dask serialises a plain ``dict``
    argument or result value by value (a header, a pickle and a frame each, which costs more
    than the values when a gathered call answers a hundred nodes). It arrives as a plain
    ``dict``. ``call`` packs plain dict arguments; actor methods that answer many nodes at
    once return one."""

    def __reduce__(self):
        return (dict, (dict(self),))


def bind(handle: Any) -> Any:
    """Bind an actor handle to the current worker (call from an actor method)."""
    if handle is not None and getattr(handle, "_worker", None) is None:
        handle._worker = get_worker()
    return handle


async def call(method: Any, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
    """``await call(handle.method, ...)`` from a component thread's event loop; raises
    ``TimeoutError`` after ``timeout`` seconds."""
    fut = method(*map(_pack, args), **{k: _pack(v) for k, v in kwargs.items()})
    wait_async = getattr(fut, "wait_async", None)
    if wait_async is not None:  # a gathered call (``Coalescer``), a ``Link``'s: awaited on this loop
        return await wait_async(timeout)
    return await asyncio.to_thread(fut.result, timeout)


def call_sync(method: Any, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
    """Blocking form of ``call`` for plain threads."""
    return method(*map(_pack, args), **{k: _pack(v) for k, v in kwargs.items()}).result(timeout)


def _pack(value: Any) -> Any:
    kind = type(value)
    return Packed(value) if kind is list else PackedDict(value) if kind is dict else value


log = logging.getLogger("astraflow.transport")

#: what Dask's actor calls raise when the actor's worker is gone (a pending call, a new one)
_LOST_MESSAGES = ("Unable to contact Actor's worker", "Worker holding Actor was lost")


def actor_lost(err: BaseException) -> bool:
    """Whether a failed actor call failed because the actor's worker is gone (not because the
    actor raised, and not a deadline)."""
    if isinstance(err, TimeoutError):
        return False
    return isinstance(err, CommClosedError) or any(m in str(err) for m in _LOST_MESSAGES)


class Link:
    """A swappable actor handle (module docstring). ``link.method(*args)`` returns an object
    with ``result(timeout)`` like an actor call's future, so ``call``/``call_sync`` take it as
    they take a handle's method. A call that finds the actor lost waits up to ``reconnect_s``
    for ``set`` to bring a new handle, then is made again on it (with its full ``timeout``);
    without one it raises the loss."""

    #: seconds before a lane that could not be reached (or closed) is tried again
    LANE_RETRY_S = 30.0
    #: seconds to wait for the actor to say where its lane is
    LANE_ASK_S = 30.0

    def __init__(self, handle: Any, what: str, reconnect_s: float = 300.0):
        self.what = what
        self.reconnect_s = reconnect_s
        self._handle = handle
        self._generation = 0
        #: the current handle's direct lane: (generation, client or None, methods, when to try again)
        self._lane: tuple[int, lane.LaneClient | None, frozenset[str], float] | None = None
        self._lane_lock = threading.Lock()
        #: the generation known to be lost (``expect_new``) while a new handle is on its way
        self._lost_generation: int | None = None
        self._bound: Any = None
        self._changed = threading.Condition()

    # ``bind`` sets ``_worker``: bind the current handle and every later one to that worker
    @property
    def _worker(self) -> Any:
        return self._bound if self._bound is not None else getattr(self._handle, "_worker", None)

    @_worker.setter
    def _worker(self, worker: Any) -> None:
        self._bound = worker
        if self._handle is not None and getattr(self._handle, "_worker", None) is None:
            self._handle._worker = worker

    def set(self, handle: Any) -> None:
        """The actor was re-placed: calls from now on (and those waiting) go to ``handle``."""
        if self._bound is not None and getattr(handle, "_worker", None) is None:
            handle._worker = self._bound
        with self._changed:
            self._handle = handle
            self._generation += 1
            self._lost_generation = None
            self._changed.notify_all()

    def expect_new(self) -> None:
        """The actor is known to be lost and is being re-placed: a call whose deadline passes
        meanwhile waits for ``set`` (up to ``reconnect_s``) instead of timing out, so a new
        worker slow to start (a Slurm queue) does not fail its callers."""
        with self._changed:
            self._lost_generation = self._generation

    def known_lost(self, generation: int) -> bool:
        with self._changed:
            return self._lost_generation == generation

    def current(self) -> tuple[Any, int]:
        with self._changed:
            return self._handle, self._generation

    def wait_for_new(self, generation: int, err: BaseException) -> None:
        """Wait until a handle newer than ``generation`` is set; raise ``err`` after ``reconnect_s``."""
        log.warning("%s is unreachable (%s): waiting up to %.0fs for it to be re-placed", self.what, err,
                    self.reconnect_s)
        with self._changed:
            if not self._changed.wait_for(lambda: self._generation != generation, timeout=self.reconnect_s):
                raise err

    def send(self, handle: Any, generation: int, name: str, args: tuple, kwargs: dict) -> Any:
        """Make one call on ``handle`` (of ``generation``): down its direct lane when that serves
        ``name``, else through Dask; returns an object with ``result(timeout)`` and ``done()``."""
        found = self._lane
        if not _settled(found, generation):
            found = self._open_lane(handle, generation)
        if found[1] is not None and name in found[2]:
            try:
                return found[1].submit(name, args, kwargs)
            except lane.LaneClosed:
                self.lane_down(generation)
        return getattr(handle, name)(*args, **kwargs)

    def lane_open(self, timeout: float = 0.0) -> bool:
        """Whether calls go down the actor's direct lane now, starting its setup if none was made
        and waiting up to ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        while True:
            handle, generation = self.current()
            state = self._lane if _settled(self._lane, generation) else self._open_lane(handle, generation)
            if state[1] is not None or time.monotonic() >= deadline:
                return state[1] is not None
            time.sleep(0.02)

    def lane_down(self, generation: int) -> None:
        """The lane closed under a call: calls go through Dask until ``LANE_RETRY_S`` have passed."""
        with self._lane_lock:
            if self._lane is not None and self._lane[0] == generation:
                self._lane = (generation, None, self._lane[2], time.monotonic() + self.LANE_RETRY_S)

    def _open_lane(self, handle: Any, generation: int) -> tuple:
        """The lane state for ``generation``; when there is none yet, calls go through Dask while a
        thread asks the actor where its lane is and connects (a lost actor must not hold a call up)."""
        with self._lane_lock:
            if _settled(self._lane, generation):
                return self._lane  # another thread is on it (or gave up for now)
            self._lane = (generation, None, frozenset(), time.monotonic() + self.LANE_RETRY_S)
        threading.Thread(target=self._connect_lane, args=(handle, generation), name="astraflow-lane-setup",
                         daemon=True).start()
        return self._lane

    def _connect_lane(self, handle: Any, generation: int) -> None:
        client, methods, retry = None, frozenset(), time.monotonic() + self.LANE_RETRY_S
        try:
            where = getattr(handle, "lane_address")().result(self.LANE_ASK_S)
            if where is None:
                retry = float("inf")  # the actor serves no lane: Dask for good
            else:
                address, names = where
                client, methods = lane.client(address, lane.connect_args(self._worker)), frozenset(names)
        except AttributeError:  # not an actor with a lane (or no handle yet)
            retry = float("inf")
        except Exception as err:
            log.warning("%s: its direct lane cannot be reached (%s: %s); calls go through Dask", self.what,
                        type(err).__name__, err)
        with self._lane_lock:
            if self._lane is not None and self._lane[0] == generation:
                self._lane = (generation, client, methods, retry)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _LinkMethod(self, name)


class FollowsDataLayer:
    """The actor API of a component that calls the data layer through ``self.dl`` (a `Link`):
    the orchestrator tells it when the data layer's worker is lost and where its replacement is."""

    dl: Link

    def reconnect(self, data_layer: Any) -> None:
        """The data layer was re-placed on another worker: calls go to ``data_layer`` from now
        on (those waiting for it are made again there)."""
        self.dl.set(bind(data_layer))

    def data_layer_lost(self) -> None:
        """The data layer's worker is gone and it is being re-placed: calls to it wait for
        ``reconnect`` instead of timing out meanwhile."""
        self.dl.expect_new()


def _settled(lane_state: tuple | None, generation: int) -> bool:
    """Whether a ``Link``'s lane state holds for ``generation``: an open lane, or none and not yet
    time to try again."""
    if lane_state is None or lane_state[0] != generation:
        return False
    client = lane_state[1]
    return not client.closed if client is not None else time.monotonic() < lane_state[3]


class _LinkMethod:
    def __init__(self, link: Link, name: str):
        self.link, self.name = link, name

    def __call__(self, *args: Any, **kwargs: Any) -> "_LinkCall":
        return _LinkCall(self.link, self.name, args, kwargs)


class _LinkCall:
    """One call through a ``Link``; ``result`` makes it, and makes it again after a re-placement.

    A call to an actor whose worker was killed does not always fail at once (a new connection
    to the dead worker's address is retried until Dask's connect timeout), so the answer is
    awaited in slices: when the link got a new handle meanwhile, the call is made again there.
    A deadline that passes while the actor is known lost (``expect_new``) waits for its
    replacement instead."""

    #: seconds between two looks at whether the actor was re-placed while a call waits
    SLICE_S = 1.0
    #: seconds a settled answer may take to be handed over by the client's event loop
    HANDOVER_S = 60.0

    def __init__(self, link: Link, name: str, args: tuple, kwargs: dict):
        self.link, self.name, self.args, self.kwargs = link, name, args, kwargs

    async def wait_async(self, timeout: float | None = None) -> Any:
        """``result`` on an event loop (``call`` uses it): a call down the direct lane is awaited
        on the loop, no thread parked; any other call, and one the lane dropped or that timed out
        while the actor was being re-placed, is made (again) as ``result`` in a thread."""
        handle, generation = self.link.current()
        state = self.link._lane
        if _settled(state, generation) and state[1] is not None and self.name in state[2]:
            try:
                return await state[1].submit(self.name, self.args, self.kwargs).wait_async(timeout)
            except lane.LaneClosed:
                self.link.lane_down(generation)
            except TimeoutError:
                if self.link.current()[1] == generation and not self.link.known_lost(generation):
                    raise
        return await asyncio.to_thread(self.result, timeout)

    def result(self, timeout: float | None = None) -> Any:
        while True:
            handle, generation = self.link.current()
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                fut = self.link.send(handle, generation, self.name, self.args, self.kwargs)
                while True:
                    left = self.SLICE_S if deadline is None else min(self.SLICE_S, deadline - time.monotonic())
                    try:
                        return fut.result(max(left, 0.001))
                    except TimeoutError:
                        done = getattr(fut, "done", None)
                        if done is None:
                            raise
                        if done():  # settled as the slice ended: its own answer (a value, or the actor's
                            # error, e.g. no batch in time), given the client's busy event loop time to
                            # hand it over (a one-slice deadline here would be mistaken for the actor's)
                            return fut.result(self.HANDOVER_S)
                        if self.link.current()[1] != generation:
                            break  # re-placed while this call waited: make it again there
                        if deadline is not None and time.monotonic() >= deadline:
                            if not self.link.known_lost(generation):
                                raise
                            self.link.wait_for_new(generation, TimeoutError(
                                f"{self.link.what} was lost and not re-placed within {self.link.reconnect_s:.0f}s"))
                            break  # its replacement is there: make the call again
            except lane.LaneClosed:
                self.link.lane_down(generation)  # made again through Dask, which tells whether the actor is gone
            except Exception as err:
                if not actor_lost(err):
                    raise
                self.link.wait_for_new(generation, err)


# -- Batch wire format ----------------------------------------------------------------------

_SEQ_ARRAYS = {"tokens": np.int32, "loss_mask": bool, "logprobs": np.float32, "policy_ids": np.int16,
               "versions": np.int32}


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)


def _reduce_batch(batch: Batch) -> tuple:
    items = batch.items
    seqs = [it.sequence for it in items]
    columns = {name: _concat([getattr(s, name) for s in seqs], dt) for name, dt in _SEQ_ARRAYS.items()}
    columns["item_loss_mask"] = _concat([it.loss_mask for it in items], bool)
    lengths = np.array([[len(s.tokens), len(it.loss_mask)] for s, it in zip(seqs, items)], np.int64).reshape(-1, 2)
    floats = np.array([[it.sequence.reward, it.group_mean, it.group_std] for it in items], np.float64).reshape(-1, 3)
    ints = np.array([[it.group_size, it.staleness, it.replayed] for it in items], np.int64).reshape(-1, 3)
    small = [(it.task_id, s.finish_reason, dict(s.rewards)) for s, it in zip(seqs, items)]
    return (_unpack_batch, (batch.policy, batch.version, dict(batch.metrics), columns, lengths, floats, ints, small))


def _restore(cls, fields: dict):
    """An instance with these fields, without ``__init__``: what plain unpickling does (the
    record was validated when its writer made it)."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _unpack_batch(policy, version, metrics, columns, lengths, floats, ints, small) -> Batch:
    parts = {}
    for name, arr in columns.items():
        ends = np.cumsum(lengths[:, 1 if name == "item_loss_mask" else 0]).tolist()
        parts[name] = [arr[a:b] for a, b in zip([0] + ends[:-1], ends)]
    fl, it = floats.tolist(), ints.tolist()
    items = []
    for i, (task_id, finish, rewards) in enumerate(small):
        seq = _restore(Sequence, {
            "tokens": parts["tokens"][i], "loss_mask": parts["loss_mask"][i], "logprobs": parts["logprobs"][i],
            "policy_ids": parts["policy_ids"][i], "versions": parts["versions"][i], "reward": fl[i][0],
            "rewards": rewards, "finish_reason": finish,
        })
        items.append(_restore(BatchItem, {
            "sequence": seq, "loss_mask": parts["item_loss_mask"][i], "group_mean": fl[i][1],
            "group_std": fl[i][2], "group_size": it[i][0], "staleness": it[i][1], "task_id": task_id,
            "replayed": bool(it[i][2]),
        }))
    return Batch(policy=policy, version=version, items=tuple(items), metrics=metrics)


copyreg.pickle(Batch, _reduce_batch)


def _reduce_batch_refs(refs: BatchRefs) -> tuple:
    items = refs.items
    segments = sorted({it.ref.segment for it in items})
    seg_no = {s: i for i, s in enumerate(segments)}
    ints = np.array([[seg_no[it.ref.segment], it.ref.index, it.group_size, it.staleness, it.replayed]
                     for it in items], np.int64).reshape(-1, 5)
    floats = np.array([[it.reward, it.group_mean, it.group_std] for it in items], np.float64).reshape(-1, 3)
    return (_unpack_batch_refs, (refs.policy, refs.version, dict(refs.metrics), segments, ints, floats,
                                 [it.task_id for it in items]))


def _unpack_batch_refs(policy, version, metrics, segments, ints, floats, task_ids) -> BatchRefs:
    items = tuple(
        _restore(RowRef, {"ref": EntryRef(segments[seg], index), "task_id": task_id, "reward": reward,
                          "group_mean": mean, "group_std": std, "group_size": size, "staleness": stale,
                          "replayed": bool(replayed)})
        for (seg, index, size, stale, replayed), (reward, mean, std), task_id
        in zip(ints.tolist(), floats.tolist(), task_ids))
    return BatchRefs(policy=policy, version=version, items=items, metrics=metrics)


copyreg.pickle(BatchRefs, _reduce_batch_refs)
