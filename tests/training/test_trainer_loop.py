"""The trainer's own loop: while step k+1 is fetched and trained, version k is committed by a
helper thread from a copy of its weights. Versions are committed and reported in order, each with the weights right after
its step and the metrics of the batch it was trained on, and the last one is committed before
the trainer says it is done.

The data-layer actor handle is the process boundary: a recorder stands in for it; the backend
(a tiny model) and the weight store (on disk) are real."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from astraflow.training.config import TrainerConfig
from astraflow.batches import Batch
from astraflow.training.torch_backend import TorchBackend
from astraflow.training.trainer import Trainer
from storage.weights import WeightStore
from tests.training.test_torch_backend import _batch


def _done(value=None):
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class _DataLayer:
    """Stands in for the data-layer handle: serves copies of one GRPO group, each tagged with
    its serial number, and records the calls in order."""

    _worker = "test"  # ``bind`` leaves a handle that is already bound alone

    def __init__(self, batch: Batch):
        self.batch = batch
        self.events: list[tuple[str, int]] = []
        self.published_batches: dict[int, dict] = {}
        self.served = 0
        self.lock = threading.Lock()

    def next_batch(self, policy, version, timeout):
        with self.lock:
            self.events.append(("next_batch", version))
            self.served += 1
            return _done(Batch(policy=policy, version=version, items=self.batch.items,
                               metrics={"serial": self.served}))

    def published(self, policy, version, metrics, batch_metrics=None):
        with self.lock:
            self.events.append(("published", version))
            self.published_batches[version] = dict(batch_metrics)
        return _done()


def _trainer(tmp_path, tiny_model, dl, max_steps):
    return Trainer(policy="p", cfg=TrainerConfig(lr=1e-3), model_path=tiny_model,
                   weights_root=str(tmp_path / "weights"), keep_versions=max_steps + 1, data_layer=dl,
                   max_steps=max_steps)


def test_background_publish_commits_every_step_in_order(tmp_path, tiny_model):
    steps = 4
    ref = TorchBackend(tiny_model, lr=1e-3)
    batch = _batch(ref.model, ref.tokenizer)
    expected = []  # the weights after each step, trained the plain way
    for _ in range(steps):
        ref.train_step(batch)
        expected.append(ref.snapshot())

    dl = _DataLayer(batch)
    tr = _trainer(tmp_path, tiny_model, dl, steps)
    assert tr.start() == 0
    deadline = time.time() + 120
    while not tr.state()["done"] and tr.state()["error"] is None and time.time() < deadline:
        time.sleep(0.05)
    st = tr.stop()
    assert st["error"] is None and st["done"] and st["version"] == steps

    # one request per step, for the version its batch is trained at
    fetched = [v for e, v in dl.events if e == "next_batch"]
    assert fetched == list(range(steps))
    # versions reported in order, each with the metrics of the batch it was trained on
    assert [v for e, v in dl.events if e == "published"] == list(range(1, steps + 1))
    assert {v: m["serial"] for v, m in dl.published_batches.items()} == {v: v for v in range(1, steps + 1)}

    # every committed version holds exactly the weights right after its step
    store = WeightStore(tmp_path / "weights")
    assert store.versions("p") == list(range(steps + 1))
    for v in range(1, steps + 1):
        got = store.load("p", v)
        for name, want in expected[v - 1].items():
            assert torch.equal(got[name], want), (v, name)


def test_a_failed_publish_stops_the_trainer_with_the_error(tmp_path, tiny_model, monkeypatch):
    ref = TorchBackend(tiny_model, lr=1e-3)
    dl = _DataLayer(_batch(ref.model, ref.tokenizer))
    tr = _trainer(tmp_path, tiny_model, dl, 5)
    tr.start(run_loop=False)
    calls = []

    def publish(store, policy, version, state=None):
        calls.append(version)
        raise OSError("disk full")

    monkeypatch.setattr(tr.backend, "publish", publish)
    tr._run()  # the loop, in this thread
    st = tr.state()
    assert st["error"] == "OSError: disk full"
    assert not st["done"] and st["version"] == 0
    assert calls[0] == 1 and ("published", 1) not in dl.events


def test_a_full_disk_in_the_trainer_ends_the_run_as_a_full_disk(tmp_path, tiny_model, monkeypatch):
    """The trainer's error crosses the actor boundary as a string; its errno goes with it, so the
    run ends with the one full-disk line (naming the file), not as a failed trainer."""
    import errno

    from astraflow.runtime.stopping import disk_full, disk_full_reason, full_disk_of

    ref = TorchBackend(tiny_model, lr=1e-3)
    tr = _trainer(tmp_path, tiny_model, _DataLayer(_batch(ref.model, ref.tokenizer)), 5)
    tr.start(run_loop=False)
    target = tmp_path / "weights" / "v1.bin"

    def publish(store, policy, version, state=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr(tr.backend, "publish", publish)
    tr._run()
    err = full_disk_of(tr.state())
    assert disk_full(err) and err.filename == str(target)
    assert disk_full_reason(err, tmp_path).startswith(f"no space left on the filesystem of {tmp_path} (writing {target}")
    elsewhere = OSError(errno.ENOSPC, "No space left on device", "/scratch/node-3/cache.bin")  # not the run's disk
    assert disk_full_reason(elsewhere, tmp_path).startswith("no space left on the filesystem of /scratch/node-3/cache.bin")
    assert f"`astraflow run` again on {tmp_path} to resume" in disk_full_reason(elsewhere, tmp_path)

    assert full_disk_of({"error": "OSError: [Errno 5] Input/output error", "error_os": (errno.EIO, None)}) is None
    assert full_disk_of({"error": "ValueError: x", "error_os": None}) is None


class _NoData(_DataLayer):
    """A data layer with nothing to serve: each call waits its timeout, then times out."""

    def next_batch(self, policy, version, timeout):
        with self.lock:
            self.events.append(("next_batch", version))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        threading.Timer(timeout, fut.set_exception, args=(TimeoutError(f"no batch within {timeout}s"),)).start()
        return fut


def test_stop_ends_a_wait_for_a_batch_that_will_not_come(tmp_path, tiny_model):
    """Ctrl-C after the nodes stopped: the trainer waits for a batch in short calls, so its
    thread ends within stop()'s join, long before ``batch_timeout_s`` (600 s); not an error."""
    ref = TorchBackend(tiny_model, lr=1e-3)
    dl = _NoData(_batch(ref.model, ref.tokenizer))
    tr = _trainer(tmp_path, tiny_model, dl, 3)
    tr.start()
    deadline = time.monotonic() + 30
    while not dl.events:  # the trainer is waiting for its first batch
        assert time.monotonic() < deadline, "the trainer never asked for a batch"
        time.sleep(0.02)
    time.sleep(0.5)
    waiting = tr.state()  # the wait in progress counts: a starved trainer shows as waiting
    assert waiting["wait_fraction"] > 0 and waiting["wait_total_s"] >= 0.5
    st = tr.stop(timeout=30)
    assert st["error"] is None and not st["done"] and st["version"] == 0
    assert not tr._thread.is_alive()


class _DataThenNone(_NoData):
    """Serves ``n`` batches, then nothing."""

    def __init__(self, batch: Batch, n: int):
        super().__init__(batch)
        self.left = n

    def next_batch(self, policy, version, timeout):
        if self.left > 0:
            self.left -= 1
            return _DataLayer.next_batch(self, policy, version, timeout)
        return super().next_batch(policy, version, timeout)


def _checkpointing(tmp_path, tiny_model, every: int):
    """A batch, the optimiser checkpoint's path, and ``trainer(data_layer)`` saving it every ``every`` steps."""
    ref = TorchBackend(tiny_model, lr=1e-3)
    path = tmp_path / "trainer_state" / "p" / "optimizer.pt"

    def trainer(dl):
        return Trainer(policy="p", cfg=TrainerConfig(lr=1e-3, optimizer_checkpoint_every=every), model_path=tiny_model,
                       weights_root=str(tmp_path / "weights"), keep_versions=10, data_layer=dl, max_steps=10,
                       optimizer_path=str(path))

    return _batch(ref.model, ref.tokenizer), path, trainer


def test_optimiser_state_is_saved_periodically_and_at_stop_and_resumed(tmp_path, tiny_model):
    batch, path, trainer = _checkpointing(tmp_path, tiny_model, every=2)

    tr = trainer(_DataThenNone(batch, 3))
    tr.start()
    deadline = time.time() + 120
    while tr.state()["version"] < 3 and time.time() < deadline:
        time.sleep(0.05)
    # three steps trained, the trainer waits for a fourth batch: the checkpoint of step 2 is there
    assert torch.load(path, weights_only=True)["version"] == 2
    st = tr.stop(timeout=30)
    assert st["version"] == 3 and st["optimizer_resumed_from"] is None
    saved = torch.load(path, weights_only=True)
    assert saved["version"] == 3 and saved["optimizer"]["state"][0]["step"] == 3  # saved on the way out

    again = trainer(_NoData(batch))
    assert again.start(run_loop=False) == 3
    assert again.state()["optimizer_resumed_from"] == 3
    assert again.backend.optimizer.state_dict()["state"][0]["step"] == 3
    again.stop()

    torch.save({"policy": "p", "version": 3, "optimizer": {"state": {}, "param_groups": []}}, path)
    third = trainer(_NoData(batch))  # a state that does not fit the model: fresh moments, no failure
    assert third.start(run_loop=False) == 3 and third.state()["optimizer_resumed_from"] is None
    assert third.state()["optimizer_fresh_why"].startswith(f"{path.name} cannot be used: ")
    assert third.backend.optimizer.state_dict()["state"] == {}

    path.write_bytes(b"not a checkpoint")  # unreadable: the same
    fourth = trainer(_NoData(batch))
    assert fourth.start(run_loop=False) == 3 and fourth.state()["optimizer_resumed_from"] is None


def test_a_resume_stopped_before_its_first_step_keeps_the_older_checkpoint_as_it_was(tmp_path, tiny_model):
    """Weights at v3, the optimiser checkpoint of v2 (saved every 2 steps): a resumed trainer
    stopped before any step must not save v2's moments labelled as v3's."""
    batch, path, trainer = _checkpointing(tmp_path, tiny_model, every=2)
    first = trainer(_DataLayer(batch))
    first.start(run_loop=False)
    for _ in range(3):
        first.step()  # v3 committed; the checkpoint of v2 on disk; the trainer ends without stop()
    assert torch.load(path, weights_only=True)["version"] == 2
    again = trainer(_NoData(batch))
    assert again.start(run_loop=False) == 3 and again.state()["optimizer_resumed_from"] == 2
    again.stop()
    assert torch.load(path, weights_only=True)["version"] == 2
    assert trainer(_NoData(batch)).start(run_loop=False) == 3


def test_a_resumed_trainer_publishes_the_run_s_step_count(tmp_path, tiny_model):
    """``train_steps`` in a version's manifest counts the run's optimiser steps, not those since
    the trainer last started (what ``astraflow export`` records of a resumed run)."""
    from storage.weights import WeightStore

    batch, _, trainer = _checkpointing(tmp_path, tiny_model, every=2)
    first = trainer(_DataLayer(batch))
    first.start(run_loop=False)
    for _ in range(2):
        first.step()
    again = trainer(_DataLayer(batch))
    assert again.start(run_loop=False) == 2
    again.step()
    store = WeightStore(str(tmp_path / "weights"))
    assert [store.manifest("p", v)["meta"]["train_steps"] for v in (0, 1, 2, 3)] == [0, 1, 2, 3]
    again.stop()


def test_a_failed_publish_keeps_the_last_usable_optimiser_checkpoint(tmp_path, tiny_model, monkeypatch):
    """Publishing fails from v4 on (a full disk): the trainer stops at v5 trained, v3 committed.
    The checkpoint of v3 stays the one a resume uses; the states of versions never committed
    wait aside and are not used."""
    batch, path, trainer = _checkpointing(tmp_path, tiny_model, every=3)

    tr = trainer(_DataLayer(batch))
    tr.start(run_loop=False)
    real = tr.backend.publish

    def publish(store, policy, version, state=None):
        if version >= 4:
            raise OSError(28, "No space left on device")
        return real(store, policy, version, state=state)

    monkeypatch.setattr(tr.backend, "publish", publish)
    tr._run()
    st = tr.state()
    assert st["version"] == 3 and st["trained_version"] > 3 and "No space left" in st["error"]
    assert torch.load(path, weights_only=True)["version"] == 3
    again = trainer(_NoData(batch))
    assert again.start(run_loop=False) == 3 and again.state()["optimizer_resumed_from"] == 3
    again.stop()


def test_stop_closes_the_backend_of_a_trainer_a_driver_stepped(tmp_path, tiny_model):
    """``run.mode: sync``: no loop of its own closes the backend (a Megatron backend's rank
    processes and work directory), so ``stop`` does."""
    batch, path, trainer = _checkpointing(tmp_path, tiny_model, every=0)
    tr = trainer(_DataLayer(batch))
    tr.start(run_loop=False)
    tr.step()
    closed = []
    tr.backend.close = lambda: closed.append(True)
    tr.stop()
    assert closed == [True] and torch.load(path, weights_only=True)["version"] == 1


class _Finishing:
    """A data layer whose run ends (``finish``) right after the trainer's ``stop`` returns, as
    the orchestrator does; it records whether a version was reported after that."""

    _worker = "test"

    def __init__(self):
        self.events: list[tuple] = []
        self.finished = False

    def next_batch(self, policy, version, timeout):
        self.events.append(("next_batch", version))
        return _done(Batch(policy=policy, version=version, items=()))

    def published(self, policy, version, metrics, batch_metrics=None):
        self.events.append(("published", version, self.finished))
        return _done()


def test_a_step_still_training_when_stop_returns_is_never_committed(tmp_path):
    """``stop`` gave up waiting for a long step and the run went on to end: the step's version
    must neither reach the weight store nor be reported to the finished data layer."""
    dl = _Finishing()
    trainer = Trainer(policy="p", cfg=TrainerConfig(backend="sim", sim_step_seconds=1.5), model_path="",
                      weights_root=str(tmp_path / "w"), keep_versions=5, data_layer=dl, max_steps=3)
    trainer.start()
    time.sleep(0.3)  # the first step trains
    state = trainer.stop(timeout=0.2)
    dl.finished = True
    at_finish = WeightStore(tmp_path / "w").versions("p")
    time.sleep(2.0)  # the step ends meanwhile
    assert state["version"] == 0
    assert WeightStore(tmp_path / "w").versions("p") == at_finish
    assert not [e for e in dl.events if e[0] == "published"], dl.events


def test_a_trainer_a_driver_steps_counts_its_idle_time_between_steps_as_waiting(tmp_path):
    """``run.mode: sync``: the driver steps the trainer once each rollout phase ended, so it never
    waits inside a step; the time between steps is its wait (what plans and status report)."""
    dl = _Finishing()
    trainer = Trainer(policy="p", cfg=TrainerConfig(backend="sim", sim_step_seconds=0.05), model_path="",
                      weights_root=str(tmp_path / "w"), keep_versions=5, data_layer=dl, max_steps=3)
    trainer.start(run_loop=False)
    for _ in range(2):
        time.sleep(0.3)  # a rollout phase
        trainer.step()
    state = trainer.stop()
    assert state["version"] == 2 and state["wait_fraction"] > 0.5, state


def _run_until_done(trainer: Trainer, timeout_s: float = 30.0) -> None:
    """Start ``trainer``'s loop and wait (at most ``timeout_s``) until it has taken its steps."""
    trainer.start()
    deadline = time.time() + timeout_s
    while not trainer.state()["done"] and time.time() < deadline:
        time.sleep(0.05)


def test_a_finished_trainers_wait_fraction_stays_what_its_last_step_said(tmp_path):
    """Status and summary read the trainer after its last step (the final evaluation, the run's
    end): the time since then is no part of its training, so the fraction must not decay."""
    dl = _Finishing()
    trainer = Trainer(policy="p", cfg=TrainerConfig(backend="sim", sim_step_seconds=0.05), model_path="",
                      weights_root=str(tmp_path / "w"), keep_versions=5, data_layer=dl, max_steps=2)
    _run_until_done(trainer)
    first = trainer.state()
    time.sleep(0.5)
    later = trainer.state()
    trainer.stop()
    assert first["done"] and later["wait_fraction"] == first["wait_fraction"]
    assert abs(later["wait_fraction"] - trainer.last_metrics["trainer_wait_fraction"]) < 1e-9


def test_a_trainers_state_never_pairs_a_version_with_the_previous_steps_metrics(tmp_path):
    """Status and the progress line show a trainer's ``version`` with its ``last_metrics`` (reward,
    loss): what ``state()`` says while a version is being committed (its optimiser state
    promoted, its delta started) must be that version's step, as reported to the data layer."""
    dl = _Finishing()
    published: dict[int, dict] = {}
    dl.published = lambda policy, version, metrics, batch_metrics=None: (
        published.__setitem__(version, dict(metrics)), _done())[1]
    seen: list[dict] = []

    class _Watched(Trainer):
        def promote_optimizer(self) -> None:  # runs while the version is committed
            seen.append(self.state())
            super().promote_optimizer()

    trainer = _Watched(policy="p", cfg=TrainerConfig(backend="sim", sim_step_seconds=0.05), model_path="",
                       weights_root=str(tmp_path / "w"), keep_versions=5, data_layer=dl, max_steps=3)
    _run_until_done(trainer)
    trainer.stop()
    mid = [s for s in seen if s["version"] >= 1]
    assert mid and all(s["last_metrics"] == published[s["version"]] for s in mid), (mid, published)


class _Starved:
    """A data layer with nothing to serve: every ``next_batch`` times out."""

    _worker = "test"

    def __init__(self):
        self.asked = threading.Event()

    def next_batch(self, policy, version, timeout):
        self.asked.set()
        time.sleep(min(timeout, 0.1))
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_exception(TimeoutError("no batch"))
        return f

    def published(self, policy, version, metrics, batch_metrics=None):
        return _done()


class _Clock:
    """The trainer module's ``time``: a clock that moves only when the test moves it."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def test_a_starved_trainer_says_how_long_it_has_waited_for_its_next_batch(tmp_path, monkeypatch):
    """Its wait fraction is over its lifetime; ``batch_wait_s`` is the wait in progress (from the
    moment it asked for the batch, across the data layer's calls that time out)."""
    import astraflow.training.trainer as trainer_module

    clock = _Clock(1000.0)
    monkeypatch.setattr(trainer_module, "time", clock)
    dl = _Starved()
    trainer = Trainer(policy="p", cfg=TrainerConfig(backend="sim", sim_step_seconds=0.05), model_path="",
                      weights_root=str(tmp_path / "w"), keep_versions=5, data_layer=dl, max_steps=3)
    trainer.start()
    try:
        assert dl.asked.wait(60), "the trainer never asked for a batch"
        assert trainer.state()["batch_wait_s"] == 0.0  # no time has passed on its clock yet
        clock.now += 7.5
        state = trainer.state()
    finally:
        trainer.stop()
    assert state["version"] == 0 and state["batch_wait_s"] == 7.5, state
    assert state["wait_total_s"] == 7.5 and state["wait_fraction"] == 1.0, state


def test_delta_history_stays_bounded_over_many_versions(tmp_path, tiny_model):
    """With ``storage.deltas`` every version adds a delta record; a run of days publishes
    hundreds of thousands of versions, so the trainer keeps only the few its state shows."""
    steps = 9
    ref = TorchBackend(tiny_model, lr=1e-3)
    dl = _DataLayer(_batch(ref.model, ref.tokenizer))
    tr = Trainer(policy="p", cfg=TrainerConfig(lr=1e-3), model_path=tiny_model, weights_root=str(tmp_path / "weights"),
                 keep_versions=3, data_layer=dl, max_steps=steps, write_deltas=True)
    assert tr.start() == 0
    deadline = time.time() + 120
    while not tr.state()["done"] and tr.state()["error"] is None and time.time() < deadline:
        time.sleep(0.05)
    st = tr.stop()
    assert st["error"] is None and st["done"]
    tr._delta_thread.join(timeout=30)  # the last version's delta is written in the background
    assert [d["version"] for d in tr.delta_history] == list(range(steps - 4, steps + 1))
    assert [d["version"] for d in tr.state()["deltas"]] == list(range(steps - 4, steps + 1))
