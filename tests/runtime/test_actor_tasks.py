"""What placing an actor sends through the Dask scheduler, which unpickles every task it is
given: naming a trainer's or a RaaS node's class, or anything defined next to it, would make the
scheduler import torch and transformers, seconds during which it serves no one. The task names
the class by a string (``runtime.construct``); the worker builds it from that."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys

from distributed.actor import Actor

from astraflow.dataflow.layer import DataLayer
from astraflow.rollout.node import RaaSNode
from astraflow.runtime.construct import by_name, class_path, construct
from astraflow.runtime.placement import Placement, data_layer_kwargs, node_kwargs, trainer_kwargs
from astraflow.training.trainer import Trainer
from storage.paths import RunPaths
from tests.conftest import ROOT, tiny_config


class _Recording:
    """A Dask client that records what it is asked to submit."""

    def __init__(self):
        self.submitted = []

    def submit(self, func, *args, **kwargs):
        self.submitted.append((func, args, kwargs))
        return None


def _modules_named(obj) -> set[str]:
    """The modules a reader of a pickle of ``obj`` imports (the classes and functions it names)."""
    class Reader(pickle.Unpickler):
        def find_class(self, module, name):
            named.add(module)
            return super().find_class(module, name)

    named: set[str] = set()
    Reader(io.BytesIO(pickle.dumps(obj, protocol=5))).load()
    return named


def test_placing_a_trainer_or_a_node_imports_neither_in_the_scheduler(tiny_model, tmp_path, monkeypatch):
    cfg = tiny_config(tiny_model)
    paths = RunPaths(tmp_path / "run").make()
    part = cfg.partitions[0]
    placement = Placement(paths, cfg.cluster, None)
    placement.client = _Recording()
    monkeypatch.setattr(placement, "joined", lambda: {"w": "tls://127.0.0.1:1"})
    monkeypatch.setattr(placement, "check_code", lambda worker, address: None)
    placement.submit_actor(DataLayer, "w", **data_layer_kwargs(cfg, paths))
    # the data layer's handle, as a real placement passes it (it names the data layer's module)
    handle = Actor(DataLayer, "tls://127.0.0.1:1", "DataLayer-x")
    placement.submit_actor(Trainer, "w", **trainer_kwargs(cfg, paths, 0, cfg.policies[0], handle, part))
    placement.submit_actor(RaaSNode, "w", **node_kwargs(cfg, paths, "rollout-0", part, handle))
    named: set[str] = set()
    for func, args, kwargs in placement.client.submitted:
        assert func is construct and kwargs["actor"] is True
        named |= _modules_named((func, args, {k: v for k, v in kwargs.items() if k not in ("workers", "key")}))
    for cls in (Trainer, RaaSNode):
        assert cls.__module__ not in named
    # what the scheduler imports to read those tasks pulls in neither torch nor transformers
    probe = f"import sys; import {', '.join(sorted(named))}; print(sorted(m for m in ('torch', 'transformers') " \
            "if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_construct_builds_the_class_it_names():
    built = construct(class_path(dict), a=1)
    assert built == {"a": 1}
    assert class_path(_Recording) == f"{__name__}:_Recording"
    assert isinstance(construct(class_path(_Recording)), _Recording)

    class Local:  # no worker could import it by name: placed as the class itself
        pass

    assert by_name(_Recording) and by_name(dict) and not by_name(Local)
    renamed = type("Elsewhere", (), {"__module__": __name__})  # its path names nothing in this module
    assert not by_name(renamed)


class _Answering:
    """A Dask client whose workers all run this process's code; it records each ``run``."""

    def __init__(self):
        self.runs = []

    def run(self, func, workers, **kwargs):
        self.runs.append(list(workers))
        return {a: func() for a in workers}


def test_the_workers_that_joined_are_asked_for_their_code_at_once(tmp_path, monkeypatch):
    """Each worker hashes its sources when asked: asked one by one as each is placed on, the run
    would wait for them in turn."""
    from astraflow.config import ClusterConfig
    from astraflow.runtime.progress import Progress

    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(), Progress(enabled=False))
    placement.client = _Answering()
    workers = {f"w{i}": f"tls://127.0.0.1:{i + 1}" for i in range(3)}
    monkeypatch.setattr(placement, "joined", lambda: workers)
    placement.wait_workers(list(workers), lambda: {})
    for name, address in workers.items():
        placement.check_code(name, address)
    assert placement.client.runs == [list(workers.values())]


def test_a_worker_at_the_address_of_one_that_left_unchecked_is_asked_itself(tmp_path, monkeypatch):
    from astraflow.config import ClusterConfig
    from astraflow.runtime.progress import Progress

    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(), Progress(enabled=False))
    placement.client = _Answering()
    monkeypatch.setattr(placement, "joined", lambda: {"w0": "tls://127.0.0.1:1"})
    placement.wait_workers(["w0"], lambda: {})  # w0 answers, then leaves before anything is placed on it
    placement.check_code("w1", "tls://127.0.0.1:1")  # its successor at the same address
    assert placement.client.runs == [["tls://127.0.0.1:1"], ["tls://127.0.0.1:1"]]
