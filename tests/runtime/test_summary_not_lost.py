"""``summary.json`` is written however the run ended: a value JSON cannot hold in the state the
components returned (a user rule's state with tuple keys) is written as a string, and the
ending's reason is kept, instead of the CLI dying with a json traceback and no summary."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

from astraflow.runtime.monitoring import Tick
from astraflow.runtime.shutdown import jsonable
from astraflow.runtime.stopping import Ending
from storage.atomic import write_json
from tests.runtime.shutdown_fakes import FakeDataLayer, done
from tests.runtime.test_stopped_run_summary import _Run


class _OddState(FakeDataLayer):
    def state(self):
        return done({"eval": [], "rules_state": {"curator": {("p1", 4): 1, "seen": {"p2"}}}})


def _summary_writer(run, extra=None):
    def write(**kw):  # as the status writer does: the parts into one JSON file
        write_json(run.paths.summary, {"status": kw["ending"].status, "reason": kw["ending"].reason,
                                       "data_layer": kw["data_layer"], **(extra or {})}, indent=2)
    return write


def test_a_summary_with_values_json_cannot_hold_is_written_with_them_as_strings(tmp_path):
    run = _Run(tmp_path / "run", _OddState(), {}, Tick(data_layer={}, trainers={}))
    run.status = SimpleNamespace(write_summary=_summary_writer(run),
                                 alive_while=lambda what: contextlib.nullcontext())
    reason = "dataflow.curator (mypkg.rules:setstate).state_dict is not plain JSON"
    run._shutdown(0.0, Ending("failed", reason))
    summary = json.loads(run.paths.summary.read_text())
    assert summary["status"] == "failed" and summary["reason"] == reason
    assert summary["data_layer"]["rules_state"]["curator"] == {"('p1', 4)": 1, "seen": ["p2"]}


def test_a_summary_the_status_cannot_write_at_all_keeps_the_ending(tmp_path):
    run = _Run(tmp_path / "run", FakeDataLayer(), {}, Tick(data_layer={}, trainers={}))
    run.status = SimpleNamespace(write_summary=_summary_writer(run, {"partitions": {(1, 2): object()}}),
                                 alive_while=lambda what: contextlib.nullcontext())
    run._shutdown(0.0, Ending("failed", "the original reason"))
    summary = json.loads(run.paths.summary.read_text())
    assert (summary["status"], summary["reason"]) == ("failed", "the original reason")
    assert "keys must be str" in summary["summary_error"]


def test_jsonable_turns_only_what_json_cannot_hold_into_strings():
    loop: list = []
    loop.append(loop)
    assert jsonable({"a": (1, 2.5), 3: None, (4,): "x"}) == {"a": [1, 2.5], 3: None, "(4,)": "x"}
    json.dumps(jsonable({"loop": loop}))  # a cycle ends in a string
