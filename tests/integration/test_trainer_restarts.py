"""Trainer restarts without a cluster: when restarts are off or spent the run fails with a line
naming the limit and the fix; the sync driver takes a step again on the restarted trainer
(through the handle swapped in the dict it holds) unless the lost one had committed it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from astraflow.runtime.progress import Progress
from astraflow.runtime.restarts import TrainerRestarts
from astraflow.runtime.sync_driver import drive_sync
from astraflow.runtime.workers import RunFailed, TrainerLost, Worker
from schedulers import JobRef
from storage.paths import RunPaths

from tests.conftest import tiny_config


class _Done:
    def __init__(self, value=None, error: Exception | None = None):
        self.value, self.error = value, error

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.value


def _lost() -> TrainerLost:
    w = Worker(job=JobRef(job_id="local-1", partition="trainer", worker_name="trainer-trainer-local-cpu-0",
                          kind="local", log=None), partition="trainer", phase="gone")
    return TrainerLost(f"trainer worker {w.name} is gone (job local-1 FAILED); see its log", w, "job local-1 FAILED")


def _restarts(tmp_path, limit: int, used: int) -> TrainerRestarts:
    cfg = tiny_config(tmp_path, **{"cluster.trainer_restarts": limit})
    r = TrainerRestarts(cfg, RunPaths(tmp_path / "run"), SimpleNamespace(), SimpleNamespace(),
                        Progress(enabled=False), {}, lambda: None)
    r.placed_on = {"solver": "trainer-trainer-local-cpu-0"}
    r.history["solver"] = [{}] * used
    return r


def test_restarts_off_fail_the_run_naming_the_setting(tmp_path):
    # in a run of several policies, whose trainer it was (the worker's name does not say)
    with pytest.raises(RunFailed, match=r"is gone \(job local-1 FAILED\).*its trainer \(solver\) is off "
                                        r"\(cluster.trainer_restarts: 0"):
        _restarts(tmp_path, 0, 0).replace(_lost())


def test_restarts_spent_fail_the_run_naming_the_limit_and_the_fix(tmp_path):
    with pytest.raises(RunFailed, match=r"already restarted 2 time\(s\).*cluster.trainer_restarts: 2\): raise it"):
        _restarts(tmp_path, 2, 2).replace(_lost())


class _Trainer:
    """A trainer at ``version`` whose first ``fail`` steps raise (its worker died)."""

    def __init__(self, version: int, fail: int = 0, commit_then_die: bool = False):
        self.version, self.fail, self.commit_then_die, self.steps = version, fail, commit_then_die, 0

    def state(self):
        return _Done({"version": self.version})

    def step(self):
        if self.fail:
            self.fail -= 1
            if self.commit_then_die:
                self.version += 1
            return _Done(error=OSError("actor is gone"))
        self.version += 1
        self.steps += 1
        return _Done({})


class _DataLayer:
    def open_iteration(self, groups):
        return _Done()

    def state(self, evals=None):
        return _Done({"outstanding_groups": 0, "pending": 0, "leased": 0})

    def ready(self, policy, version):
        return _Done(16)


@pytest.mark.parametrize("committed", [False, True])
def test_the_sync_driver_steps_the_restarted_trainer(committed):
    lost = _Trainer(0, fail=1, commit_then_die=committed)
    trainers = {"solver": lost}
    new = _Trainer(0)

    def recover(policy, err) -> bool:  # what the orchestrator does: a new trainer, resumed, swapped in place
        assert policy == "solver" and isinstance(err, OSError)
        new.version = lost.version
        trainers["solver"] = new
        return True

    iterations = drive_sync(_DataLayer(), trainers, lambda: [], 16, 4, 3, 10.0, recover=recover)
    assert [it["step"] for it in iterations] == [1, 2, 3]
    assert new.version == 3 and new.steps == (2 if committed else 3)


def test_a_trainer_lost_while_a_sync_batch_fills_is_restarted(tmp_path):
    """``run.mode: sync``: a trainer worker lost between two steps is seen by the orchestrator's
    tick while the driver waits (not by a failed step): it is replaced, as after a failed step,
    instead of failing the run whatever ``cluster.trainer_restarts`` allows."""
    import contextlib

    from astraflow.runtime.orchestrator import Orchestrator

    lost, new = _Trainer(0), _Trainer(0)
    replaced: list[TrainerLost] = []

    class _Run:
        _sync_loop, _replace_trainer = Orchestrator._sync_loop, Orchestrator._replace_trainer

        def __init__(self):
            self.cfg = tiny_config(tmp_path, **{"run.max_steps": 3, "dataflow.batch_size": 16,
                                               "workload.group_size": 4})
            self.dl, self.trainers, self.ticks = _DataLayer(), {"solver": lost}, 0
            self.fleet = SimpleNamespace(serving_nodes=lambda: [], raise_full_disk=lambda dl: None)
            self.nothing_completes = SimpleNamespace(check_layer=lambda dl: None)
            self.status = SimpleNamespace(alive_while=lambda what: contextlib.nullcontext())
            self.restarts = SimpleNamespace(replace=self._replace)

        def _replace(self, why: TrainerLost) -> None:  # what TrainerRestarts.replace does: a new one, resumed
            replaced.append(why)
            new.version = lost.version
            self.trainers["solver"] = new

        def _tick(self):
            self.ticks += 1
            if self.ticks == 1:  # the worker died after the first step
                raise _lost()
            return SimpleNamespace(data_layer={})

        def _show(self, tick) -> None:
            pass

    run = _Run()
    run._sync_loop(time.time())
    assert len(replaced) == 1 and [it["step"] for it in run.iterations] == [1, 2, 3]
    assert (lost.steps, new.steps, new.version) == (1, 2, 3)


def test_the_sync_driver_raises_what_is_not_a_lost_trainer():
    with pytest.raises(OSError):
        drive_sync(_DataLayer(), {"solver": _Trainer(0, fail=1)}, lambda: [], 16, 4, 3, 10.0)


class _SlowDataLayer(_DataLayer):
    """Each iteration's batch is ready a while after the iteration opens, and taken by its step
    (``_TakingTrainer``): the driver opens the next iteration only once it is taken."""

    def __init__(self, ready_after_s: float):
        self.ready_after_s, self.opened = ready_after_s, None

    def open_iteration(self, groups):
        import time

        self.opened = time.time()
        return _Done()

    def _ready(self) -> bool:
        import time

        return self.opened is not None and time.time() - self.opened >= self.ready_after_s

    def state(self, evals=None):  # the iteration's groups out until its batch is ready: no top-up
        out = 4 if self.opened is not None and not self._ready() else 0
        return _Done({"outstanding_groups": out, "pending": 0, "leased": out})

    def ready(self, policy, version):
        return _Done(16 if self._ready() else 0)


class _TakingTrainer(_Trainer):
    def __init__(self, dl: _SlowDataLayer):
        super().__init__(0)
        self.dl = dl

    def step(self):
        self.dl.opened = None  # the batch taken
        return super().step()


def test_the_sync_driver_keeps_one_deadline_for_all_its_iterations():
    """Five iterations of 0.3 s each do not fit 1 s, though each one alone would."""
    slow = _SlowDataLayer(0.3)
    with pytest.raises(TimeoutError, match="run deadline passed in sync iteration"):
        drive_sync(slow, {"solver": _TakingTrainer(slow)}, lambda: [], 16, 4, 5, 1.0)
    fast = _SlowDataLayer(0.05)
    assert len(drive_sync(fast, {"solver": _TakingTrainer(fast)}, lambda: [], 16, 4, 5, 5.0)) == 5


def test_a_trainer_whose_backend_lost_a_process_is_restarted_as_a_lost_worker(tmp_path):
    """A rank of a Megatron trainer killed from outside (``error_lost``): ``TrainerLost`` for its
    worker, marked gone so that the partition is refilled; any other trainer error is left to fail
    the run."""
    r = _restarts(tmp_path, 2, 0)
    w = Worker(job=JobRef(job_id="local-1", partition="trainer", worker_name="trainer-trainer-local-cpu-0",
                          kind="local", log=None), partition="trainer", phase="serving")
    r.fleet = SimpleNamespace(workers={w.name: w})
    failed = {"error": "ValueError: the loss raised", "error_lost": False}
    r.backend_lost("solver", failed)  # not a lost process: nothing raised here, the run fails on it
    assert not w.gone
    killed = {"error": "RankKilled: rank(s) [1] exited during 'train': rank 1 was killed by SIGKILL\n--- rank 1 log",
              "error_lost": True}
    with pytest.raises(TrainerLost, match=r"^trainer solver on worker trainer-trainer-local-cpu-0 lost a process "
                                          r"of its backend \(RankKilled: .* killed by SIGKILL\)$") as lost:
        r.backend_lost("solver", killed)
    assert lost.value.worker is w and w.gone and lost.value.why.startswith("RankKilled: rank(s) [1]")


class _Starting:
    """A trainer that starts at ``version`` and resumed the optimiser state of ``opt``."""

    def __init__(self, version: int, opt: int | None, **extra):
        self.version, self.opt, self.extra = version, opt, extra

    def start(self, run_loop=True):
        return _Done(self.version)

    def state(self):
        return _Done({"version": self.version, "optimizer_resumed_from": self.opt, **self.extra})


class _Placement:
    def wait_all(self, label, futures):
        return {p: f.result() for p, f in futures.items()}


@pytest.mark.parametrize("version, opt, extra, said", [
    (7, 7, {}, "trainer solver resumes at v7 with the optimiser state of v7"),
    (7, 5, {}, "trainer solver resumes at v7 with the optimiser state of v5 (2 steps older than its weights)"),
    (7, None, {}, "trainer solver resumes at v7 with a fresh optimiser state (no usable checkpoint"),
    (7, None, {"optimizer_fresh_why": "optimizer.pt cannot be used: KeyError: 'exp_avg'", "resumed_from_rounded": True},
     "trainer solver resumes at v7 with a fresh optimiser state (optimizer.pt cannot be used: KeyError: 'exp_avg'), "
     "from its published weights rounded to their publish dtype"),
    (0, None, {}, None),  # a new run says nothing of it
])
def test_a_resumed_start_says_which_optimiser_state_each_trainer_goes_on_with(tmp_path, version, opt, extra, said):
    r = _restarts(tmp_path, 1, 0)
    r.placement = _Placement()
    notes: list[str] = []
    r.progress.note = notes.append
    r.start_all({"solver": _Done(_Starting(version, opt, **extra))}, lambda: None)
    resumed = [n for n in notes if "resumes at" in n]
    assert (resumed[0].startswith(said) if said else not resumed), notes


def test_a_sync_step_that_lost_a_backend_process_restarts_the_trainer(tmp_path):
    """``run.mode: sync``: a step that raised because a rank was killed from outside (the trainer's
    worker still alive) is a lost trainer, restarted within ``cluster.trainer_restarts`` as in an
    asynchronous run; a step's own error, with the worker alive, is not."""
    from astraflow.training.backend import BackendProcessLost

    r = _restarts(tmp_path, 2, 0)
    w = Worker(job=JobRef(job_id="local-1", partition="trainer", worker_name="trainer-trainer-local-cpu-0",
                          kind="local", log=None), partition="trainer", phase="serving")
    r.fleet = SimpleNamespace(workers={w.name: w}, check_core=lambda wait_s: None)
    r.check_step_failure("solver", ValueError("the loss raised"))
    assert not w.gone
    with pytest.raises(TrainerLost, match=r"lost a process of its backend \(BackendProcessLost: rank 1 .*SIGKILL\)"):
        r.check_step_failure("solver", BackendProcessLost("rank 1 was killed by SIGKILL"))
    assert w.gone
