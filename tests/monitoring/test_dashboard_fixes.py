"""The AstraFlow page and its endpoints as users reach them: two runs' dashboards in one browser,
behind a site proxy that serves them under a path prefix, a rare episode filter on a store larger
than the reader's cache, a run that ends under the page, reads kept off the event loop, and
reward filters that make no sense."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
import urllib.parse
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from tornado import web
from tornado.httpserver import HTTPServer

from astraflow.runtime import dashboard
from astraflow.runtime.monitoring import MetricsReader
from astraflow.runtime.monitoring.episodes import EpisodeQuery, EpisodeReader, episode_views, matches
from storage.paths import RunPaths
from storage.trajectories import open_trajectory_store

from tests.monitoring.episode_store import single_turn


@contextmanager
def serve(app: web.Application):
    """``app`` on a loop in a thread: yields ``(port, stop)``; ``stop()`` closes the server and
    its connections, as when a run's scheduler exits."""
    box: dict = {}
    ready = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        srv = HTTPServer(app)
        srv.listen(0, "127.0.0.1")
        box.update(port=next(iter(srv._sockets.values())).getsockname()[1], loop=loop, srv=srv,
                   thread=threading.current_thread().name)
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True, name="dashboard-loop").start()
    assert ready.wait(10)

    def stop() -> None:
        async def close() -> None:
            box["srv"].stop()
            await box["srv"].close_all_connections()
            asyncio.get_running_loop().stop()

        box["loop"].call_soon_threadsafe(lambda: asyncio.ensure_future(close()))

    try:
        yield box["port"], stop
    finally:
        if box["loop"].is_running():
            stop()


def get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read().decode(errors="replace")
    finally:
        conn.close()


def guarded_app(run_dir, token: str) -> web.Application:
    app = web.Application(dashboard.routes(run_dir))
    dashboard.require_token(app, token)
    return app


def make_store(run_dir, batches: int, *, eval_at=()):
    """A run directory whose store holds ``batches`` batches of two entries, rewards ``b / 10``
    for batch ``b``; the batches ``eval_at`` are of kind eval."""
    paths = RunPaths(run_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(yaml.safe_dump({"workload": {"name": "sums"}, "policies": [{"name": "solver"}],
                                            "storage": {"trajectories": None}}))
    add_batches(run_dir, range(batches), eval_at=eval_at)
    return run_dir


def add_batches(run_dir, numbers, *, eval_at=(), segment="rollout-1"):
    store = open_trajectory_store(str(RunPaths(run_dir).trajectories), "a", durable=False)
    with store.writer(segment) as w:
        for b in numbers:
            kind = "eval" if b in eval_at else "train"
            w.write([row for i in range(2) for row in single_turn(f"st-{b}-{i}", reward=b / 10, kind=kind).to_stored()])
            time.sleep(0.002)  # distinct publication times


def truth(run_dir, q: EpisodeQuery) -> list[str]:
    """Task ids of every match of ``q``, newest first, read from every batch."""
    store = open_trajectory_store(str(RunPaths(run_dir).trajectories), "r")
    every = [e for seg in store.segments() for n in range(store.batch_count(seg))
             for e in episode_views(store.batch(seg, n), "sums")]
    every.sort(key=lambda e: (e.written_at, e.id), reverse=True)
    return [e.task_id for e in every if matches(e, q)]


# ------------------------------------------------------------------ two runs in one browser


def test_each_run_keeps_its_own_token_cookie(tmp_path):
    """Browsers do not separate cookies by port: two tunnelled dashboards share one cookie jar."""
    with serve(guarded_app(tmp_path, "token-of-run-a")) as (port_a, _), \
            serve(guarded_app(tmp_path, "token-of-run-b")) as (port_b, _):
        jar = []
        for port, token in ((port_a, "token-of-run-a"), (port_b, "token-of-run-b")):
            status, headers, _ = get(port, f"/astraflow?token={token}")
            assert status == 302
            cookie = headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
            jar.append(cookie.split(";")[0])
        names = [c.split("=")[0] for c in jar]
        assert names[0] != names[1] and all(n.startswith(dashboard.TOKEN_COOKIE) for n in names)
        assert "token-of-run" not in names[0]  # derived from the token, not the token itself
        both = {"Cookie": "; ".join(jar)}  # what the browser sends to either port
        assert get(port_a, "/astraflow/api/metrics.json", both)[0] == 200
        assert get(port_b, "/astraflow/api/metrics.json", both)[0] == 200
        assert get(port_a, "/astraflow/api/metrics.json", {"Cookie": jar[1]})[0] == 403  # B's cookie opens B only


# ------------------------------------------------------------------ behind a path-prefix proxy


@contextmanager
def prefix_proxy():
    """``/proxy/<port>/<path>`` -> ``http://127.0.0.1:<port>/<path>``, headers passed unchanged
    both ways (``Location`` not rewritten), as jupyter-server-proxy and Open OnDemand do."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            parts = self.path.split("/", 3)
            if len(parts) < 3 or parts[1] != "proxy" or not parts[2].isdigit():
                self.send_response(404)
                self.end_headers()
                return
            hdrs = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            status, headers, body = get(int(parts[2]), "/" + (parts[3] if len(parts) > 3 else ""), hdrs)
            data = body.encode()
            self.send_response(status)
            for k, v in headers.items():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_page_works_under_a_path_prefix(tmp_path):
    make_store(tmp_path, 2)
    with serve(guarded_app(tmp_path, "tok")) as (port, _), prefix_proxy() as proxy:
        origin, prefix = f"http://127.0.0.1:{proxy}", f"/proxy/{port}/"
        status, headers, _ = get(proxy, f"{prefix}astraflow?token=tok&refresh=300")
        assert status == 302
        page_url = urllib.parse.urljoin(f"{origin}{prefix}astraflow?token=tok&refresh=300", headers["Location"])
        assert page_url == f"{origin}{prefix}astraflow?refresh=300"  # the prefix kept, the token dropped
        cookie = {"Cookie": headers["Set-Cookie"].split(";")[0]}
        status, headers, _ = get(proxy, f"{prefix}astraflow/", cookie)  # a trailing slash goes to the page
        assert status in (301, 302)
        assert urllib.parse.urljoin(f"{origin}{prefix}astraflow/", headers["Location"]) == f"{origin}{prefix}astraflow"

        status, _, page = get(proxy, f"{prefix}astraflow?refresh=300", cookie)
        assert status == 200 and "<title>AstraFlow run</title>" in page
        refs = [u for u in re.findall(r'(?:href|src)="([^"#]+)"', page) if not u.startswith("data:")]
        assert refs and not [u for u in refs if u.startswith("/") or "//" in u], refs  # relative only
        scripts = [u for u in refs if u.endswith(".js")]
        assert len(scripts) == 2
        urls = [u for u in refs if "astraflow/" in u]
        for src in scripts:
            js = get(proxy, urllib.parse.urlparse(urllib.parse.urljoin(page_url, src)).path, cookie)[2]
            assert not re.search(r"""["'`]/astraflow""", js), f"{src} uses an absolute URL"
            urls += re.findall(r"""["'`](\./astraflow/api/[a-z]+\.json)""", js)
        api = re.findall(r'const API = "([^"]+)"', get(proxy, f"{prefix}astraflow/static/astraflow.js", cookie)[2])
        urls += [api[0] + "episodes.json"]
        assert {u.rsplit("/", 1)[-1] for u in urls} >= {"status.json", "metrics.json", "episodes.json",
                                                         "astraflow.css", "astraflow.js", "astraflow-episodes.js"}
        for u in urls:
            target = urllib.parse.urlparse(urllib.parse.urljoin(page_url, u)).path
            assert target.startswith(prefix), (u, target)
            status, _, body = get(proxy, target, cookie)
            # status.json answers 503 (JSON) until the run writes its first snapshot
            assert status == 200 or (target.endswith("status.json") and status == 503), (u, status, body[:200])


# ------------------------------------------------------------------ rare filters on a large store


@pytest.mark.parametrize("query", [{"max_reward": 0.0}, {"kind": "eval"}, {"min_reward": 100.0}])
def test_a_rare_filter_finishes_on_a_store_larger_than_the_cache(tmp_path, query):
    run_dir = make_store(tmp_path / "run", 60, eval_at={3, 41})
    q = EpisodeQuery(limit=100, sample=0, **query)
    reader = EpisodeReader(run_dir, read_budget=4, cache_entries=8)  # four batches cached of sixty
    for i in range(40):
        v = reader.view(q)
        if i == 2 and query == {"kind": "eval"}:  # published while the walk goes on: it comes first
            add_batches(run_dir, [70], eval_at={70}, segment="rollout-2")
        if not v.partial:
            break
    assert not v.partial, f"still partial after {i + 1} requests"
    assert [e.task_id for e in v.recent] == truth(run_dir, q)
    assert reader._cached <= 8
    if query == {"kind": "eval"}:
        assert [e.task_id for e in v.recent][:2] == ["st-70-1", "st-70-0"]


def test_interleaved_filters_each_go_on(tmp_path):
    run_dir = make_store(tmp_path / "run", 40)
    reader = EpisodeReader(run_dir, read_budget=4, cache_entries=8)
    rare, none, follow = (EpisodeQuery(limit=100, sample=0, max_reward=0.0), EpisodeQuery(min_reward=50.0),
                          EpisodeQuery(limit=4, sample=2))
    done = {}
    for _ in range(40):
        for name, q in (("rare", rare), ("none", none), ("follow", follow)):
            v = reader.view(q)
            if not v.partial:
                done.setdefault(name, v)
    assert set(done) == {"rare", "none", "follow"}
    assert [e.task_id for e in done["rare"].recent] == ["st-0-1", "st-0-0"] and done["none"].recent == []
    assert [e.task_id for e in done["follow"].recent] == ["st-39-1", "st-39-0", "st-38-1", "st-38-0"]


# ------------------------------------------------------------------ reads off the event loop, bounded curves


def test_status_and_metrics_are_read_off_the_event_loop(tmp_path, monkeypatch):
    threads: list[str] = []

    def status(run_dir):
        threads.append(threading.current_thread().name)
        raise ValueError("no status snapshot yet")

    real = MetricsReader.view
    monkeypatch.setattr(dashboard, "build_status_view", status)
    monkeypatch.setattr(MetricsReader, "view", lambda self: threads.append(threading.current_thread().name)
                        or real(self))
    with serve(web.Application(dashboard.routes(tmp_path))) as (port, _):
        assert get(port, "/astraflow/api/status.json")[0] == 503
        assert get(port, "/astraflow/api/metrics.json")[0] == 200
    assert len(threads) == 2 and not [t for t in threads if t == "dashboard-loop"], threads


def test_metrics_json_thins_curves_on_request(tmp_path):
    lines = [{"step": i, "policy": "p", "time": float(i), "reward_mean": i / 1000} for i in range(1000)]
    lines += [{"step": i, "policy": "p", "time": float(i), "eval_accuracy": 0.5} for i in range(0, 1000, 10)]
    RunPaths(tmp_path).metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with serve(web.Application(dashboard.routes(tmp_path))) as (port, _):
        every = json.loads(get(port, "/astraflow/api/metrics.json")[2])["policies"]["p"]
        assert len(every["step"]) == 1000 and len(every["eval_step"]) == 100  # the API keeps every point
        status, _, body = get(port, "/astraflow/api/metrics.json?max_points=50")
        c = json.loads(body)["policies"]["p"]
        assert status == 200 and 2 <= len(c["step"]) <= 50 and len(c["eval_step"]) <= 50
        assert c["step"][0] == 0 and c["step"][-1] == 999 and c["eval_step"][-1] == 990  # the last point kept
        assert len(c["reward_mean"]) == len(c["time"]) == len(c["step"]) and c["reward_mean"][-1] == 0.999
        assert c["step"] == sorted(set(c["step"]))
        gaps = {b - a for a, b in zip(c["step"], c["step"][1:])}
        assert max(gaps) - min(gaps) <= 1  # evenly spaced
        for bad in ("1", "0", "x", "-5", "9" * 5000):  # past int()'s digit limit too
            status, _, body = get(port, f"/astraflow/api/metrics.json?max_points={bad}")
            assert status == 400 and "max_points" in json.loads(body)["error"]


# ------------------------------------------------------------------ reward filters that make no sense


@pytest.mark.parametrize("args,why", [
    ("min_reward=1&max_reward=0", "above max_reward"), ("min_reward=nan", "finite"), ("max_reward=nan", "finite"),
    ("min_reward=inf", "finite"), ("max_reward=-inf", "finite"), ("min_reward=1e400", "finite"),
])
def test_nonsensical_reward_filters_are_refused(tmp_path, args, why):
    with serve(web.Application(dashboard.routes(tmp_path))) as (port, _):
        status, _, body = get(port, f"/astraflow/api/episodes.json?{args}")
    assert status == 400 and why in json.loads(body)["error"] and not json.loads(body)["error"].startswith(":"), body
    assert EpisodeQuery(min_reward=0.5, max_reward=0.5).min_reward == 0.5  # one value is a range


# ------------------------------------------------------------------ the page when the run ends


@pytest.mark.browser
@pytest.mark.timeout(180)
def test_the_page_says_when_the_run_stops_answering(tmp_path):
    from tests.monitoring.test_monitoring import _driver

    driver = _driver(tmp_path)  # skips where chromium or selenium is missing
    try:
        with serve(guarded_app(tmp_path, "tok")) as (port, stop):
            driver.get(f"http://127.0.0.1:{port}/astraflow?token=tok&refresh=300")

            def error(want: str, deadline_s: float = 30.0) -> str:
                deadline = time.time() + deadline_s
                while True:
                    got = driver.execute_script("const e = document.getElementById('error');"
                                                "return e.hidden ? '' : e.textContent;")
                    if want in got or time.time() > deadline:
                        return got
                    time.sleep(0.1)

            assert "no run has started" in error("no run has started")  # a JSON error: its message
            driver.delete_all_cookies()  # the next answer is the 403 text
            got = error("needs the run's token")
            assert "needs the run's token" in got and "JSON" not in got, got
            stop()
            got = error("no answer from the run")
            assert "no answer from the run: it ended, or the connection (tunnel) dropped" in got, got
            assert "astraflow status" in got
            assert driver.execute_script("return document.getElementById('run-state').textContent;") == "no answer"
    finally:
        driver.quit()
