"""A workload subclassed to change its reward keeps the subclass's own parameters: the built-in
workloads validate ``params`` with ``type(self).Params``, as ``astraflow check`` does."""

from __future__ import annotations

from astraflow.workloads.base import make_workload
from astraflow.workloads.math import MathConfig, MathWorkload


class PartialParams(MathConfig):
    partial: float = 0.0


class PartialMath(MathWorkload):
    """Exact match, or ``partial`` credit for an answer off by one."""

    Params = PartialParams

    def reward(self, completion, payload):
        exact = super().reward(completion, payload)
        close = completion.strip().lstrip("-").isdigit() and abs(int(completion) - int(payload["answer"])) == 1
        return exact or (self.cfg.partial if close else 0.0)


def test_a_subclass_of_the_math_workload_takes_its_own_parameters():
    wl = make_workload(f"{__name__}:PartialMath", {"digits": 1, "num_test": 5, "partial": 0.5}, 0)
    assert wl.cfg.partial == 0.5
    payload = wl.tasks("train")[0]
    answer = int(payload["answer"])
    assert wl.reward(str(answer), payload) == 1.0 and wl.reward(str(answer + 1), payload) == 0.5
