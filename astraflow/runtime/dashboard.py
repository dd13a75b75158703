"""Runtime room, scheduler preload: the AstraFlow page on the Dask dashboard of a run.

HPC users already open the Dask dashboard of their cluster; this puts what an RL run needs on
the same server (same port, same bind address, a link in the dashboard's top bar):

* ``/astraflow`` — the page (``static/astraflow.html`` + ``astraflow.js``, no CDN: it works
  on a compute node without internet), refreshed every 2 s from the two endpoints below; its
  URLs are relative, so it works behind a site proxy that serves the dashboard under a prefix;
* ``/astraflow/api/status.json`` — :class:`astraflow.runtime.monitoring.StatusView`;
* ``/astraflow/api/metrics.json?max_points=`` — :class:`astraflow.runtime.monitoring.MetricsView`
  (every point, or at most ``max_points`` per curve, evenly spaced, the last one kept);
* ``/astraflow/api/episodes.json?limit=&sample=&workload=&policy=&kind=&min_reward=&max_reward=``
  — :class:`astraflow.runtime.monitoring.episodes.EpisodesView`: the newest stored episodes and
  a sample of older ones, turn by turn, for the page's episode viewer (fetched on demand).

Loaded with ``dask scheduler --preload astraflow.runtime.dashboard``; the run directory comes
from ``ASTRAFLOW_RUN_DIR`` (set by :class:`astraflow.runtime.cluster.SchedulerProcess`). The
endpoints only read files of the run directory (the orchestrator's ``control/status.json``, the
data layer's ``metrics.jsonl``, the trajectory store's newest batches: a bounded read per request,
on threads of their own, off the scheduler's event loop), so the page never slows the run down.
Every handler answers GET only: nothing on this server changes the run.

Access: the dashboard binds to loopback by default. Bound to another address it is served over
HTTPS and every request (Dask's pages, their websockets, this page) must carry the run's token:
``?token=`` once (it is then kept in a cookie named after the token, so that the dashboards of two
runs open in one browser keep theirs), or an ``Authorization: token ...`` header.
``ASTRAFLOW_DASHBOARD_TOKEN_FILE`` names the token's file, ``ASTRAFLOW_DASHBOARD_ACCESS`` what the
page says about access.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlencode

from pydantic import ValidationError
from tornado import web
from tornado.ioloop import IOLoop

from astraflow.runtime.monitoring import MetricsReader, MetricsView, build_status_view
from astraflow.runtime.monitoring.episodes import EpisodeQuery, EpisodeReader

log = logging.getLogger("astraflow.dashboard")

RUN_DIR_ENV = "ASTRAFLOW_RUN_DIR"
TOKEN_FILE_ENV = "ASTRAFLOW_DASHBOARD_TOKEN_FILE"
#: set when the dashboard is served over HTTPS (its token cookie is then ``Secure``)
HTTPS_ENV = "ASTRAFLOW_DASHBOARD_HTTPS"
ACCESS_ENV = "ASTRAFLOW_DASHBOARD_ACCESS"
#: prefix of the token cookie's name (`token_cookie`)
TOKEN_COOKIE = "astraflow_dashboard"
STATIC = Path(__file__).with_name("static")
PAGE = "astraflow"


class _JSON(web.RequestHandler):
    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    def _fail(self, code: int, msg: str) -> None:
        self.set_status(code)
        self.finish(json.dumps({"error": msg}))


def token_cookie(token: str) -> str:
    """The name of the cookie that keeps ``token``: one per run, since browsers share cookies
    between ports (two runs' dashboards tunnelled to localhost would otherwise log each other out)."""
    return f"{TOKEN_COOKIE}_{hashlib.sha256(token.encode()).hexdigest()[:12]}"


def thin(view: MetricsView, max_points: int) -> MetricsView:
    """``view`` with at most ``max_points`` points per curve, evenly spaced, the first and last kept
    (the page asks for this: the whole history at every poll would grow without bound)."""
    def pick(n: int) -> list[int]:
        if n <= max_points:
            return list(range(n))
        return sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})

    policies = {}
    for name, c in view.policies.items():
        steps, evals = pick(len(c.step)), pick(len(c.eval_step))
        fields = {k: ([v[i] for i in (evals if k.startswith("eval_") else steps)] if isinstance(v, list) else v)
                  for k, v in c.model_dump().items()}
        policies[name] = type(c)(**fields)
    return view.model_copy(update={"policies": policies})


class StatusHandler(_JSON):
    def initialize(self, run_dir: Path, pool: ThreadPoolExecutor) -> None:
        self.run_dir, self.pool = run_dir, pool

    async def get(self) -> None:
        try:  # off the event loop: a slow file system never stalls the scheduler
            body = await IOLoop.current().run_in_executor(
                self.pool, lambda: build_status_view(self.run_dir).model_dump_json())
        except ValueError as err:  # no status snapshot yet: the page shows the message and retries
            return self._fail(503, str(err))
        self.finish(body)


class MetricsHandler(_JSON):
    def initialize(self, reader: MetricsReader, pool: ThreadPoolExecutor) -> None:
        self.reader, self.pool = reader, pool

    async def get(self) -> None:
        raw = self.get_argument("max_points", "").strip()
        if raw and (not (raw.isascii() and raw.isdigit()) or len(raw) > 9 or int(raw) < 2):
            return self._fail(400, f"max_points: an integer of at least 2 expected, got {raw!r}")

        def read() -> str:  # on the pool's one thread: the reader is not thread-safe
            view = self.reader.view()
            return (thin(view, int(raw)) if raw else view).model_dump_json()

        self.finish(await IOLoop.current().run_in_executor(self.pool, read))


class EpisodesHandler(_JSON):
    def initialize(self, reader: EpisodeReader, pool: ThreadPoolExecutor) -> None:
        self.reader, self.pool = reader, pool

    async def get(self) -> None:
        args = {k: v for k in EpisodeQuery.model_fields if (v := self.get_argument(k, "").strip())}
        try:
            query = EpisodeQuery.model_validate(args)
        except ValidationError as err:
            return self._fail(400, "; ".join(": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"])))
                                             for e in err.errors()))
        try:  # the reader's one thread: store reads never block the scheduler's event loop
            view = await IOLoop.current().run_in_executor(self.pool, self.reader.view, query)
        except Exception as err:  # e.g. a store of another layout version: the page shows why
            log.warning("episodes.json: %s", err, exc_info=True)
            return self._fail(500, f"{type(err).__name__}: {err}")
        self.finish(view.model_dump_json())


class PageHandler(web.RequestHandler):
    def get(self) -> None:
        if self.request.path.endswith("/"):  # the page's URLs are relative to ``<prefix>/astraflow``
            query = self.request.query
            return self.redirect(f"../{PAGE}" + (f"?{query}" if query else ""))
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        access = os.environ.get(ACCESS_ENV, "this machine only (loopback)")
        page = (STATIC / "astraflow.html").read_text().replace("{{ACCESS}}", html.escape(access))
        self.finish(page.encode())


class TokenRequired(web.RequestHandler):
    """Answers every request that lacks the run's token."""

    WHY = "This AstraFlow dashboard needs the run's token"

    def prepare(self) -> None:
        self.set_status(403)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(f"{self.WHY}: open the address `astraflow run` printed "
                    "(also in <run dir>/security/dashboard.url), or send 'Authorization: token <token>'.\n")


class TokenWrong(TokenRequired):
    """Answers a request whose token is not the run's: most often an address of an earlier start of
    the run (each start, a resume too, makes a new token)."""

    WHY = ("The token given is not this AstraFlow dashboard's (each start of the run, a resume too, makes a "
           "new one)")


class TokenAccepted(web.RequestHandler):
    """A request with a valid ``?token=``: keep the token in a cookie, then go to the page asked for."""

    def prepare(self) -> None:
        token = self.get_query_argument("token")
        self.set_cookie(token_cookie(token), token, httponly=True,
                        secure=bool(os.environ.get(HTTPS_ENV)), samesite="Strict", path="/")
        rest = urlencode([(k, v.decode()) for k, vs in self.request.query_arguments.items() if k != "token"
                          for v in vs])
        # relative to the request (``./`` + its last segment): a site proxy's path prefix is kept,
        # and it never leaves this server (``//host/x`` or ``https:x`` would)
        self.redirect("./" + self.request.path.rsplit("/", 1)[-1] + (f"?{rest}" if rest else ""))


def require_token(app: web.Application, token: str) -> None:
    """Route every request of `app` without `token` to `TokenRequired` (its one entry point is
    ``find_handler``: Dask's pages, Bokeh's websockets and the AstraFlow page alike)."""
    find = app.find_handler
    name = token_cookie(token)

    def valid(value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(value.encode(), token.encode())  # type: ignore[union-attr]

    def guarded(request, **kwargs):
        auth = request.headers.get("Authorization", "")
        cookie = request.cookies.get(name)
        if valid(auth.removeprefix("token ").strip()) or (cookie is not None and valid(cookie.value)):
            return find(request, **kwargs)
        query = request.query_arguments.get("token")
        if query and valid(query[0].decode(errors="replace")):
            return app.get_handler_delegate(request, TokenAccepted)
        return app.get_handler_delegate(request, TokenWrong if query or auth.startswith("token ") else TokenRequired)

    app.find_handler = guarded  # type: ignore[method-assign]


class StaticHandler(web.StaticFileHandler):
    def set_extra_headers(self, path: str) -> None:
        self.set_header("Cache-Control", "no-cache")  # revalidate: an upgraded AstraFlow serves new assets


def routes(run_dir: Path) -> list[tuple]:
    """The AstraFlow routes for ``run_dir`` (also used by tests on a plain tornado app)."""
    files = ThreadPoolExecutor(max_workers=1, thread_name_prefix="astraflow-files")  # status and metrics
    episodes = {"reader": EpisodeReader(run_dir),
                "pool": ThreadPoolExecutor(max_workers=1, thread_name_prefix="astraflow-episodes")}
    return [
        (rf"/{PAGE}/?", PageHandler),
        (rf"/{PAGE}/api/status\.json", StatusHandler, {"run_dir": run_dir, "pool": files}),
        (rf"/{PAGE}/api/metrics\.json", MetricsHandler, {"reader": MetricsReader(run_dir), "pool": files}),
        (rf"/{PAGE}/api/episodes\.json", EpisodesHandler, episodes),
        (rf"/{PAGE}/static/(.*)", StaticHandler, {"path": str(STATIC)}),
    ]


def _link_from_dashboard(scheduler) -> None:
    """Add the page to the Dask dashboard's top bar (its page list is shared by every
    dashboard document, so appending to it is enough)."""
    try:
        from distributed.dashboard.scheduler import template_variables
    except ImportError:  # no bokeh: the Dask dashboard has no top bar to link from
        return
    pages = template_variables(scheduler)["pages"]
    if PAGE not in pages:
        pages.append(PAGE)


def dask_setup(scheduler) -> None:  # noqa: D401  (Dask preload hook)
    # a worker leaving as the run stops closes its comm mid-send: Dask logs that at INFO with a
    # traceback, which reads as an error in the log of a run that ended well
    logging.getLogger("distributed.batched").setLevel(logging.WARNING)
    run_dir = os.environ.get(RUN_DIR_ENV)
    app = getattr(scheduler, "http_application", None)
    if not run_dir or app is None:
        log.warning("AstraFlow page not installed: %s", "no dashboard" if app is None else f"{RUN_DIR_ENV} is not set")
        return
    token_file = os.environ.get(TOKEN_FILE_ENV)
    if token_file:
        require_token(app, Path(token_file).read_text().strip())
    app.add_handlers(r".*$", routes(Path(run_dir)))
    _link_from_dashboard(scheduler)
