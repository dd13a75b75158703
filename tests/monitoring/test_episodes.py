"""The episode viewer's reader on a real trajectory store: turns as recorded by the agent loop,
single-turn entries, filters, newest-first order across segments, the deterministic sample,
the read budget and the batch cache; and the endpoint's query parsing."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from astraflow.models import build_tokenizer
from astraflow.runtime.monitoring.episodes import EpisodeQuery, EpisodeReader, EpisodesView
from storage.paths import RunPaths
from storage.trajectories import TrajectoryStore, open_trajectory_store

from tests.monitoring.episode_store import HOSTILE, single_turn, write_run


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def run_dir(tok, tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("episodes") / "run", tok)


def ids(views) -> list[str]:
    return [e.task_id for e in views]


def test_agentic_episodes_turn_by_turn_newest_first(run_dir):
    v = EpisodeReader(run_dir).view(EpisodeQuery())
    EpisodesView.model_validate_json(v.model_dump_json())  # the JSON the endpoint serves
    assert v.note is None and v.batches == 9 and not v.partial and v.sampled == []
    assert ids(v.recent) == ["ag-truncated", "ag-hostile", "ag-solved"] + [
        f"st-{b}-{i}" for b in range(5, -1, -1) for i in (1, 0)]
    assert v.workloads == ["arith", "sums"] and v.policies == ["solver"]
    trunc, hostile, solved = v.recent[:3]
    # a tool call, its result, then the answer: every turn as the agent loop recorded it
    assert [t.kind for t in solved.turns] == ["observation", "model", "tool", "model", "env"]
    assert solved.turns[0].messages[0].content == "2+3?"
    model = solved.turns[1]
    assert model.text.startswith("<tool_call>") and model.versions == [3, 3] and model.finish == "stop"
    call = solved.turns[2].calls[0]
    assert (call.name, call.arguments, call.result, call.valid) == ("add", {"a": 2, "b": 3}, "5", True)
    last = solved.turns[-1]
    assert last.done and last.reward == 1.0 and last.info == {"success": 1.0}
    assert (solved.workload, solved.reward, solved.final_reward, solved.truncated) == ("arith", 1.0, 1.0, None)
    assert solved.rewards == {"final": 1.0, "turns": 0.0} and solved.stats["tool_calls"] == 1.0
    assert solved.task == {"a": 2, "b": 3, "source": "arith", "difficulty": 1} and solved.node == "rollout-0"
    assert solved.num_tokens == solved.turns[-1].end > 0
    # per-turn reward, and model text kept verbatim (the page escapes it)
    assert hostile.workload == "sums" and hostile.reward == 0.25 and hostile.rewards["turns"] == 0.25
    assert [t.reward for t in hostile.turns if t.kind == "env"] == [0.25, 0.0]
    assert hostile.turns[3].text == HOSTILE
    assert trunc.truncated == "max_turns" and trunc.final_reward == 0.0 and trunc.reward == 0.5
    assert {tuple(t.versions) for t in trunc.turns if t.kind == "model"} == {(4, 4)}
    # a single-turn entry has no episode log: its reward and meta only
    st = v.recent[3]
    assert st.turns == [] and st.task is None and st.truncated is None and st.workflow == "single_turn"
    assert (st.workload, st.reward, st.num_tokens, st.kind) == ("sums", 0.5, 4, "train")


@pytest.mark.parametrize("query,expected", [
    ({"workload": "arith"}, ["ag-solved"]),
    ({"workload": "sums", "min_reward": 0.2, "limit": 3}, ["ag-truncated", "ag-hostile", "st-5-1"]),
    ({"min_reward": 0.35, "max_reward": 0.45}, ["st-4-1", "st-4-0"]),
    ({"kind": "eval"}, []),
    ({"policy": "critic"}, []),
])
def test_filters(run_dir, query, expected):
    v = EpisodeReader(run_dir).view(EpisodeQuery(**query))
    assert ids(v.recent) == expected


def test_budget_sample_and_cache(tok, tmp_path, monkeypatch):
    run_dir = write_run(tmp_path / "run", tok)
    reads: list[tuple[str, int]] = []
    real = TrajectoryStore.batch
    monkeypatch.setattr(TrajectoryStore, "batch", lambda self, seg, n: reads.append((seg, n)) or real(self, seg, n))
    reader = EpisodeReader(run_dir, read_budget=2)  # per request: one batch + one per segment, one sampled
    v = reader.view(EpisodeQuery(limit=2, sample=2))
    # truncated (rollout-0 batch 2), then hostile (rollout-0 batch 1), newer than rollout-1's last
    assert ids(v.recent) == ["ag-truncated", "ag-hostile"] and not v.partial
    # older batches: rollout-0 0, rollout-1 0..5: evenly spaced picks, the middle match of each;
    # the budget reads one batch per request
    assert ids(v.sampled) == ["st-0-1"]
    assert reads == [("rollout-0", 2), ("rollout-1", 5), ("rollout-0", 1), ("rollout-1", 0)]
    v = reader.view(EpisodeQuery(limit=2, sample=2))
    assert ids(v.sampled) == ["st-0-1", "st-4-1"] and len(reads) == 5
    assert reader.view(EpisodeQuery(limit=2, sample=2)) == v and len(reads) == 5  # published batches are read once
    # a cold reader with a small budget shows the true newest, more at every request
    cold = EpisodeReader(run_dir, read_budget=2)
    got = [cold.view(EpisodeQuery(limit=20, sample=0)) for _ in range(3)]
    assert [(len(g.recent), g.partial) for g in got] == [(2, True), (9, True), (15, False)]
    assert ids(got[1].recent) == ids(got[2].recent)[:9]
    small = EpisodeReader(run_dir, cache_entries=2)  # memory stays bounded, the answer is the same
    assert small.view(EpisodeQuery(limit=20, sample=0)).recent == got[2].recent and small._cached <= 2
    # a batch published later is on top at the next request
    w = open_trajectory_store(str(RunPaths(run_dir).trajectories), "a", durable=False).writer("rollout-2")
    w.write(single_turn("late", reward=0.9, kind="eval").to_stored())
    v = reader.view(EpisodeQuery(limit=1, sample=0))
    assert ids(v.recent) == ["late"] and v.recent[0].kind == "eval" and v.batches == 10


def test_stores_that_cannot_be_read_here_say_why(tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    reader = EpisodeReader(paths.root)
    v = reader.view(EpisodeQuery())
    assert v.recent == [] and v.note == "no trajectories stored yet"
    paths.config.write_text("workload: {name: math}\nstorage: {trajectories: 'memory://x'}\npolicies: [{name: p}]\n")
    v = EpisodeReader(paths.root).view(EpisodeQuery())
    assert v.store is None and "memory://x" in v.note and v.workloads == ["math"] and v.policies == ["p"]


@pytest.fixture(scope="module")
def server(run_dir):
    """The AstraFlow routes on a plain tornado app in a thread: ``http://127.0.0.1:<port>``."""
    import asyncio

    from tornado import web
    from tornado.httpserver import HTTPServer

    from astraflow.runtime.dashboard import routes

    box: dict = {}
    ready = threading.Event()

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        srv = HTTPServer(web.Application(routes(run_dir)))
        srv.listen(0, "127.0.0.1")
        box["port"] = next(iter(srv._sockets.values())).getsockname()[1]
        box["loop"] = loop
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{box['port']}"
    box["loop"].call_soon_threadsafe(box["loop"].stop)


def test_endpoint_parses_the_query(server):
    with urllib.request.urlopen(f"{server}/astraflow/api/episodes.json?limit=1&workload=arith&policy=&kind=") as r:
        v = EpisodesView.model_validate_json(r.read())
    assert ids(v.recent) == ["ag-solved"]
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{server}/astraflow/api/episodes.json?limit=0&min_reward=x")
    assert err.value.code == 400 and "limit" in json.loads(err.value.read())["error"]


@pytest.mark.browser
@pytest.mark.timeout(180)
def test_page_shows_episode_turns_and_filters_in_a_browser(server, tmp_path):
    from tests.monitoring.test_monitoring import _driver

    driver = _driver(tmp_path)  # skips where chromium or selenium is missing
    try:
        driver.get(f"{server}/astraflow?refresh=300")

        def js(script: str, *args):
            return driver.execute_script(script, *args)

        def shown(deadline_s: float = 30.0, want=None) -> list[str]:
            """Task ids of the episodes on the page, once there are some (and they are ``want``)."""
            deadline = time.time() + deadline_s
            while True:
                got = js("return Array.from(document.querySelectorAll('#episodes .episode')).map(e => e.dataset.task);")
                if got and (want is None or got == want) or time.time() > deadline:
                    return got
                time.sleep(0.1)

        got = shown()
        assert got[:3] == ["ag-truncated", "ag-hostile", "ag-solved"], got
        # the solved episode turn by turn: the tool call and its result, weight versions, rewards
        turns = js("""const e = document.querySelector('[data-task="ag-solved"]'); e.open = true;
                      return Array.from(e.querySelectorAll('.turn')).map(t => [t.dataset.kind, t.textContent]);""")
        assert [k for k, _ in turns] == ["observation", "model", "tool", "model", "env"]
        assert "user: 2+3?" in turns[0][1]
        assert "v3" in turns[1][1] and "<tool_call>" in turns[1][1]
        assert 'add({"a":2,"b":3})' in turns[2][1] and "→ 5" in turns[2][1]
        assert "reward 1.000" in turns[4][1] and "done" in turns[4][1]
        summary = js("return document.querySelector('[data-task=\"ag-solved\"] summary').textContent;")
        assert "reward 1.000 (final 1.000, turns 0.000)" in summary and "arith" in summary
        # model output is shown as text, never as markup
        text = js("""const e = document.querySelector('[data-task="ag-hostile"]');
                     return e.querySelectorAll('.turn-model pre')[1].textContent;""")
        assert text == HOSTILE
        assert js("return document.querySelector('#episodes img') === null && window.pwned === undefined;")
        assert "truncated: max_turns" in js(
            "return document.querySelector('[data-task=\"ag-truncated\"] summary').textContent;")
        assert "no turn log" in js("return document.querySelector('[data-task=\"st-5-1\"]').textContent;")
        js("document.querySelector('[data-task=\"ag-hostile\"]').open = true;"
           "document.getElementById('episodes-section').scrollIntoView();")
        driver.save_screenshot(str(tmp_path / "episodes.png"))
        print(f"\nscreenshot of the episode viewer: {tmp_path / 'episodes.png'}")
        # filters: a workload, then a reward range
        js("const s = document.getElementById('ep-workload'); s.value = 'arith'; document.getElementById('ep-apply').click();")
        assert shown(want=["ag-solved"]) == ["ag-solved"]
        js("""document.getElementById('ep-workload').value = '';
              document.getElementById('ep-min').value = '0.35'; document.getElementById('ep-max').value = '0.45';
              document.getElementById('ep-apply').click();""")
        assert shown(want=["st-4-1", "st-4-0"]) == ["st-4-1", "st-4-0"]
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
        assert not errors, errors
    finally:
        driver.quit()


def test_a_segment_deleted_while_the_viewer_reads_it_is_left_out(tok, tmp_path, monkeypatch):
    """``storage.keep_trajectories: false`` deletes segments under a running viewer: one listed
    before its deletion and read after it is left out, not an error."""
    run_dir = write_run(tmp_path / "run", tok)
    reader = EpisodeReader(run_dir)
    assert len(reader.view(EpisodeQuery()).recent) == 15  # three agentic episodes, six batches of two
    reader._cache.clear()  # the batches are read from the store again
    reader._walks.clear()
    listed = reader._store.segments()
    open_trajectory_store(str(RunPaths(run_dir).trajectories), "a").delete_segment("rollout-1")
    real, calls = TrajectoryStore.segments, []

    def segments(self):  # the first listing is the one taken just before the deletion
        calls.append(1)
        return listed if len(calls) == 1 else real(self)

    monkeypatch.setattr(TrajectoryStore, "segments", segments)
    v = reader.view(EpisodeQuery())
    assert ids(v.recent) == ["ag-truncated", "ag-hostile", "ag-solved"] and len(calls) == 2


def test_a_call_that_could_not_be_read_is_shown_invalid(tmp_path):
    """An unreadable tool call counts in the episode's ``invalid_calls``; the view says it is not
    valid (``valid: False``) rather than unknown, also for episodes stored without the flag."""
    from astraflow.runtime.monitoring.episodes import _turn
    from tests.monitoring.episode_store import agentic

    tok = build_tokenizer()
    run_dir = write_run(tmp_path / "run", tok, old_batches=0)
    episode = agentic(tok, "ag-unreadable", ["<tool_call>{oops</tool_call>", "5"], {"a": 2, "b": 3})
    store = open_trajectory_store(str(RunPaths(run_dir).trajectories), "a", durable=False)
    with store.writer("rollout-2") as w:
        time.sleep(0.002)  # the newest episode
        w.write(episode.to_stored())
    shown = EpisodeReader(run_dir).view(EpisodeQuery(limit=1)).recent[0]
    calls = [c for t in shown.turns for c in t.calls]
    assert shown.stats["invalid_calls"] == 1.0 and len(calls) == 1, calls
    assert calls[0].error and calls[0].valid is False
    assert _turn({"kind": "tool", "calls": [{"error": "not JSON"}]}).calls[0].valid is False  # stored before the flag


def test_a_mixtures_single_turn_episodes_show_and_filter_by_their_source(tmp_path):
    """A ``mix`` run's episodes are single-turn (no episode log with the task): their source is
    read from what the node stored (``Trajectory.source``), not shown as the run's ``mix``."""
    from dataclasses import replace

    import yaml

    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir(parents=True)
    workload = {"name": "mix", "params": {"sources": {"add2": {}, "mul1": {}}}}
    paths.config.write_text(yaml.safe_dump({"workload": workload, "policies": [{"name": "solver"}],
                                            "storage": {"trajectories": None}}))
    store = open_trajectory_store(str(paths.trajectories), "a", durable=False)
    with store.writer("rollout-1") as w:
        for i, src in enumerate(["add2", "mul1", "add2"]):
            w.write(replace(single_turn(f"st-{i}", reward=0.0), source=src).to_stored())
            time.sleep(0.002)
    v = EpisodeReader(paths.root).view(EpisodeQuery())
    assert [e.workload for e in v.recent] == ["add2", "mul1", "add2"] and v.workloads == ["add2", "mul1"]
    assert ids(EpisodeReader(paths.root).view(EpisodeQuery(workload="add2")).recent) == ["st-2", "st-0"]
    # the mixture's own name is offered only where a stored episode bears it (one written without
    # its source): otherwise `--workload mix` would be offered and match nothing
    with store.writer("rollout-2") as w:
        w.write(single_turn("st-old", reward=0.0).to_stored())
    assert EpisodeReader(paths.root).view(EpisodeQuery()).workloads == ["add2", "mix", "mul1"]
