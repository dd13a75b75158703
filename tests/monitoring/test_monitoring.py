"""Monitoring of a real run: the AstraFlow page on the Dask dashboard (in headless Debian
chromium), its JSON endpoints against the documented schema, ``astraflow status --json`` and
``astraflow plot``. One tiny orchestrated run (module fixture) serves every test here; it is
held at step 0 until a test lets it go on (``held_workflow.py``), so that the browser test sees
its step change however slowly the page renders."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.monitoring import SCHEMA_VERSION, MetricsReader, MetricsView, StatusView, build_status_view, read_metrics
from astraflow.runtime.monitoring.episodes import EpisodeQuery, EpisodeReader, EpisodesView
from astraflow.runtime.orchestrator import Orchestrator

from tests.conftest import run_in_thread, tiny_config
from tests.monitoring.held_workflow import HOLD_ENV, hold

MAX_STEPS = 10
WORKFLOW = "tests.monitoring.held_workflow:held_single_turn_test"  # single_turn, held by the test
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


class LiveRun:
    def __init__(self, run_dir: Path, thread: threading.Thread, box: dict, hold_file: Path):
        self.run_dir, self.thread, self.box, self.hold_file = run_dir, thread, box, hold_file
        self.captured: dict = {}  # what the dashboard served while the run was live
        self.capturer = threading.Thread(target=self._capture, daemon=True)
        self.capturer.start()

    def _capture(self) -> None:
        """Fetch every AstraFlow endpoint once the run's nodes lease (the run is short: tests
        check the answers afterwards, whatever order they run in)."""
        try:
            base = self.dashboard_base()
            self.captured["base"] = base
            self.captured["status"] = self.leasing(base)
            self.captured["metrics"] = _get(f"{base}/astraflow/api/metrics.json")
            self.captured["episodes"] = _get(f"{base}/astraflow/api/episodes.json")
            for key, path in (("page", "/astraflow"), ("js", "/astraflow/static/astraflow.js"), ("dask", "/status")):
                with _open(base + path) as r:
                    self.captured[key] = r.read().decode()
        except Exception as err:  # handed to the test that reads the capture
            self.captured["error"] = err

    def leasing(self, base: str, timeout: float = 120.0) -> dict:
        """The status the dashboard serves once tasks are leased (on a busy machine the first
        snapshots come before the nodes lease), or the last one after ``timeout``."""
        deadline = time.time() + timeout
        while True:
            status = _get(f"{base}/astraflow/api/status.json")
            if (status.get("ledger") or {}).get("totals", {}).get("leased", 0) > 0 or time.time() > deadline:
                return status
            time.sleep(0.2)

    def dashboard_base(self, timeout: float = 120.0) -> str:
        """``http://host:port`` of the run's dashboard, once the orchestrator wrote it."""
        f = self.run_dir / "control" / "orchestrator.json"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if "error" in self.box:
                raise self.box["error"]
            if f.exists():
                dash = json.loads(f.read_text()).get("dashboard")
                assert dash, "the orchestrator wrote no dashboard address"
                _TOKEN["token"] = (self.run_dir / "security" / "dashboard.token").read_text().strip()
                return dash.rsplit("/", 1)[0]
            time.sleep(0.2)
        raise TimeoutError(f"no dashboard address in {f} within {timeout}s")

    def hold(self, version: int | None) -> None:
        """Episodes generated with weights of ``version`` or later are held back by the nodes
        (None: none are, the run goes on to its last step)."""
        hold(self.hold_file, version)

    def finish(self, timeout: float = 240.0):
        self.hold(None)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not finish"
        assert "error" not in self.box, self.box.get("error")
        return self.box["result"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless chromium, started before the run (``live_run`` asks for it first): on a busy
    2-core machine chromium's start-up took longer than the whole 10-step run, and the page
    then only ever showed the last step. Where chromium or selenium is missing it yields the
    reason instead (the browser test skips with it; the others do not need a browser)."""
    try:
        driver = _driver(tmp_path_factory.mktemp("chromium"))
    except pytest.skip.Exception as why:
        yield str(why)
        return
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def live_run(browser, tiny_model, tmp_path_factory):
    """The run, held at step 0 (every episode held back) until a test moves the hold or
    ``finish`` releases it; its workers read the hold file named in their environment."""
    cfg = tiny_config(tiny_model, **{"run.max_steps": MAX_STEPS, "workload.eval.every": 5,
                                     "workload.workflow": WORKFLOW})
    tmp = tmp_path_factory.mktemp("monitoring")
    run_dir, hold_file = tmp / "run", tmp / "hold"
    hold(hold_file, 0)
    os.environ[HOLD_ENV] = str(hold_file)
    th = None
    try:
        th, box = run_in_thread(Orchestrator(cfg, run_dir))
        yield LiveRun(run_dir, th, box, hold_file)
    finally:
        hold(hold_file, None)
        if th is not None:
            th.join(240)
        os.environ.pop(HOLD_ENV, None)


#: the run's dashboard token, read with its address (every request carries it)
_TOKEN: dict[str, str] = {}


def _open(url: str):
    return urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"token {_TOKEN['token']}"}),
                                  timeout=10)


def _get(url: str, deadline_s: float = 90.0) -> dict:
    """GET a JSON endpoint, retrying while it answers 503 (no status snapshot yet)."""
    deadline = time.time() + deadline_s
    while True:
        try:
            with _open(url) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            if err.code != 503 or time.time() > deadline:
                raise
        time.sleep(0.3)


def _driver(tmp: Path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("Debian chromium + chromium-driver are not installed (tests/run.sh installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1400", f"--user-data-dir={tempfile.mkdtemp(dir=tmp)}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_page_shows_live_values_in_a_browser(browser, live_run, tmp_path):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    if isinstance(browser, str):
        pytest.skip(browser)
    driver = browser
    base = live_run.dashboard_base()
    driver.get(f"{base}/astraflow?token={_TOKEN['token']}&refresh=300")  # kept in a cookie from here

    def read(elem_id: str) -> str | None:
        try:
            return driver.find_element("id", elem_id).get_attribute("data-value")
        except (NoSuchElementException, StaleElementReferenceException):
            return None  # not rendered yet, or re-rendered while read

    # The page re-renders every 300 ms: read through JavaScript, which runs between
    # renders, instead of holding element references that a re-render makes stale.
    def js_text(selector: str) -> str:
        return driver.execute_script(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", selector)

    def js_count(selector: str) -> int:
        return driver.execute_script("return document.querySelectorAll(arguments[0]).length;", selector)

    seen: list[int] = []
    deadline = time.time() + 180  # a bound for a broken page, not a pace: the run waits for the page

    def wait_for(what: str, done) -> None:
        """Poll the page until ``done()``, recording each new trainer step it shows."""
        while True:
            value = read("policy-solver-step")
            if value is not None and (not seen or int(value) != seen[-1]):
                seen.append(int(value))
            if done():
                return
            assert live_run.thread.is_alive(), f"the run ended before the page showed {what}: {live_run.box}"
            assert time.time() < deadline, f"the page did not show {what}; trainer steps it showed: {seen}"
            time.sleep(0.1)

    # the run is held at step 0 until the page shows it; then it may train up to version 3
    # (it stops between steps 3 and 5), and the page must follow without being reloaded
    wait_for("the trainer step", lambda: bool(seen))
    assert seen == [0], f"the held run is at step 0, the page showed {seen}"
    live_run.hold(3)
    wait_for("a later trainer step", lambda: seen[-1] > 0)
    # the charts are drawn from metrics.json, fetched with the status: wait for the same refresh
    wait_for("the charts", lambda: js_count("#chart-solver-reward svg polyline") > 0
             and js_count("#chart-solver-staleness svg rect") > 0)
    assert seen == sorted(seen) and seen[-1] <= MAX_STEPS, f"trainer steps on the page: {seen}"
    # the run's nodes, their weight versions and the ledger are on the page
    text = js_text("body")
    for name in ("rollout-rollout-local-cpu-0", "rollout-rollout-local-cpu-1", "data-data-local-cpu-0"):
        assert name in text
    assert "solver:v" in js_text("#node-rollout-rollout-local-cpu-0-versions")
    assert int(js_text('#ledger-totals td[data-key="created"]')) > 0
    # script errors fail the test (503s before the first status snapshot are expected)
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
    assert not errors, errors
    shot = tmp_path / "astraflow-page.png"
    driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"\nscreenshot of the AstraFlow page: {shot}; trainer steps it showed: {seen}")


@pytest.mark.timeout(240)
def test_endpoints_follow_the_schema_while_running(live_run):
    live_run.capturer.join(180)
    cap = live_run.captured
    assert "error" not in cap, cap.get("error")
    assert cap["base"].startswith("http://127.0.0.1:"), "the dashboard binds to localhost by default"
    view = StatusView.model_validate(cap["status"])  # extra="forbid": an undocumented field fails here
    assert view.running and not view.finished
    assert [p.name for p in view.policies] == ["solver"]
    roles = {p.name: p.role for p in view.partitions}
    assert roles == {"data": "data", "trainer": "trainer", "rollout": "rollout"}
    rollout = next(p for p in view.partitions if p.role == "rollout")
    assert len(rollout.nodes) == 2 and all(n.hardware == "cpu" and n.region == "local" for n in rollout.nodes)
    assert view.ledger.totals["created"] >= view.ledger.totals["leased"] > 0
    mv = MetricsView.model_validate(cap["metrics"])
    assert mv.schema_version == view.schema_version == SCHEMA_VERSION
    ev = EpisodesView.model_validate(cap["episodes"])
    assert ev.store == str(live_run.run_dir / "trajectories") and ev.workloads == ["math"]
    # the page and its assets are served by the same server, and the Dask dashboard links to it
    assert "/astraflow/static/astraflow.js" in cap["page"]
    assert "/astraflow/api/status.json" in cap["js"]
    assert 'href="astraflow"' in cap["dask"]


def _timeless(view: StatusView) -> dict:
    """The view without the fields measured against the clock of the reader."""
    d = view.model_dump(exclude={"age_s"})
    for part in d["partitions"]:
        for node in part["nodes"]:
            node.pop("last_seen_s")
    return d


@pytest.mark.timeout(300)
def test_status_json_and_plots_after_the_run(live_run, tmp_path):
    result = live_run.finish()
    assert result.steps == {"solver": MAX_STEPS}
    view = build_status_view(live_run.run_dir)
    assert view.finished and not view.running
    pol = view.policies[0]
    assert pol.step == pol.max_steps == MAX_STEPS
    assert pol.eval_step == MAX_STEPS and pol.eval_accuracy is not None
    assert sum(pol.staleness_hist.values()) == pol.consumed
    assert view.ledger.totals["consumed"] == pol.consumed
    assert view.ledger.open == 0 and view.ledger.tasks == result.ledger["tasks"]  # the final ledger
    # the episode viewer reads the run's single-turn entries (no turn log) from its store
    ev = EpisodeReader(live_run.run_dir).view(EpisodeQuery(limit=5, kind="train"))
    assert len(ev.recent) == 5
    assert {(e.workload, e.workflow, len(e.turns)) for e in ev.recent} == {("math", WORKFLOW, 0)}
    # `astraflow status --json` prints the same view as the endpoint
    res = CliRunner().invoke(main, ["status", str(live_run.run_dir), "--json"])
    assert res.exit_code == 0, res.output
    cli = StatusView.model_validate_json(res.output)
    assert _timeless(cli) == _timeless(view)
    res = CliRunner().invoke(main, ["status", str(live_run.run_dir), "--json", "--metrics"])
    assert res.exit_code == 0, res.output
    curves = MetricsView.model_validate_json(res.output).policies["solver"]
    assert curves.step == list(range(1, MAX_STEPS + 1))
    assert curves.eval_step[-1] == MAX_STEPS and len(curves.eval_accuracy) == len(curves.eval_step)
    assert curves.staleness_hist == pol.staleness_hist  # the durable record agrees with the live state
    # plots
    out = tmp_path / "plots"
    res = CliRunner().invoke(main, ["plot", str(live_run.run_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(p.name for p in out.iterdir())
    assert names == ["accuracy.png", "reward.png", "staleness.png", "throughput.png"]
    for png in out.iterdir():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = plt.imread(png)
        assert img.shape[0] >= 200 and img.shape[1] >= 300, (png, img.shape)
        assert img.std() > 0.01, f"{png} is blank"
    assert res.output.split() == [str(out / n) for n in ("reward.png", "accuracy.png", "throughput.png", "staleness.png")]


def test_metrics_reader_reads_only_complete_appended_lines(tmp_path):
    f = tmp_path / "metrics.jsonl"
    line = {"step": 1, "policy": "a", "time": 1.0, "reward_mean": 0.5, "data_staleness_hist": {"0": 3}}
    f.write_text(json.dumps(line) + "\n" + json.dumps({**line, "step": 2})[:20])  # second line half written
    reader = MetricsReader(tmp_path)
    v = reader.view()
    assert v.lines == 1 and v.policies["a"].step == [1]
    with f.open("a") as fh:
        fh.write(json.dumps({**line, "step": 2})[20:] + "\n")
        fh.write(json.dumps({"step": 2, "policy": "a", "time": 2.0, "eval_accuracy": 0.25}) + "\n")
        # a round every task of which failed: an evaluation line without an accuracy, not a step
        fh.write(json.dumps({"step": 2, "policy": "a", "time": 2.5, "eval_prompts": 0, "eval_failed_tasks": 4}) + "\n")
    v = reader.view()
    assert v.lines == 4
    c = v.policies["a"]
    assert c.step == [1, 2] and c.reward_mean == [0.5, 0.5] and c.loss == [None, None]
    assert c.eval_step == [2] and c.eval_accuracy == [0.25] and c.staleness_hist == {"0": 6}
    assert read_metrics(tmp_path) == v  # a fresh reader agrees with the incremental one


def test_status_of_a_directory_without_a_run_names_the_fix(tmp_path):
    res = CliRunner().invoke(main, ["status", str(tmp_path), "--json"])
    assert res.exit_code == 2 and "--run-dir" in res.output
    res = CliRunner().invoke(main, ["plot", str(tmp_path)])
    assert res.exit_code == 2 and "no metrics" in res.output


@pytest.mark.timeout(300)
def test_tensorboard_mirror_of_metrics(live_run, tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard export is optional (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    live_run.finish()
    res = CliRunner().invoke(main, ["tensorboard", str(live_run.run_dir), "--logdir", str(tmp_path / "tb"), "--follow"])
    assert res.exit_code == 0, res.output
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    curves = read_metrics(live_run.run_dir).policies["solver"]
    reward = ea.Scalars("solver/reward_mean")
    assert [e.step for e in reward] == curves.step
    assert [e.value for e in reward] == pytest.approx(curves.reward_mean)
    acc = ea.Scalars("solver/eval/eval_accuracy")
    assert [e.step for e in acc] == curves.eval_step
