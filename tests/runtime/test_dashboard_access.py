"""Who can open a run's dashboard, on a real scheduler with the AstraFlow preload: loopback by
default; HTTPS and the run's token when it is exposed; and no endpoint that changes state."""

from __future__ import annotations

import http.client
import ssl
import urllib.parse

import pytest
from distributed import Client
from tornado import web

from astraflow.config import ClusterConfig
from astraflow.runtime import dashboard
from astraflow.runtime.cluster import SchedulerProcess
from astraflow.runtime.security import client_security, dashboard_token, run_tls
from schedulers.tls import TLSConfig
from storage.paths import RunPaths

WRITES = ("POST", "PUT", "DELETE", "PATCH")
#: Dask's own pages and JSON, ours, and the HTTP API Dask can serve when configured to
PATHS = ("/astraflow", "/astraflow/api/status.json", "/astraflow/api/metrics.json", "/astraflow/api/episodes.json",
         "/astraflow/static/astraflow.js", "/status", "/info/main/workers.html", "/json/identity.json", "/health",
         "/metrics", "/sitemap.json", "/api/v1/retire_workers", "/api/v1/adaptive_target", "/api/v1/get_workers")


def _dashboard(paths, files, token_file):
    proc = SchedulerProcess(paths, "127.0.0.1", 0, tls=files, dashboard_token_file=token_file)
    address = proc.start()
    with Client(address, timeout=20, security=client_security(files)) as client:
        port = client.scheduler_info()["services"]["dashboard"]
    return proc, port


def _request(port, method, path, tls_ctx=None, headers=None):
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=tls_ctx, timeout=10) if tls_ctx
            else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    try:
        conn.request(method, path, body=b"{}" if method in WRITES else None, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read().decode(errors="replace")
    finally:
        conn.close()


@pytest.fixture
def exposed(tmp_path):
    """A dashboard served as when `cluster.dashboard_host` is not loopback (bound to loopback
    here all the same: tests keep their traffic on this machine)."""
    paths = RunPaths(tmp_path / "run").make()
    files = run_tls(paths, TLSConfig())
    token_file = dashboard_token(paths)
    proc, port = _dashboard(paths, files, token_file)
    ctx = ssl.create_default_context(cafile=str(files.ca_file))  # the run's authority, host name checked
    yield port, ctx, token_file.read_text().strip()
    proc.stop()


def test_an_exposed_dashboard_needs_https_and_the_token(exposed):
    port, ctx, token = exposed
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        _request(port, "GET", "/astraflow")  # plain HTTP: the server speaks TLS only
    for path in ("/astraflow", "/status", "/json/identity.json", "/astraflow/api/status.json"):
        status, _, body = _request(port, "GET", path, ctx)
        assert status == 403 and "token" in body, path
    assert _request(port, "GET", "/astraflow?token=wrong", ctx)[0] == 403

    status, headers, _ = _request(port, "GET", f"/astraflow?token={urllib.parse.quote(token)}", ctx)
    assert status == 302 and headers["Location"] == "./astraflow"
    status, headers, _ = _request(port, "GET", f"//elsewhere/x?token={urllib.parse.quote(token)}&w=a%26b%20c", ctx)
    assert status == 302 and headers["Location"] == "./x?w=a%26b+c"  # relative (a proxy prefix kept), arguments kept
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "Secure" in cookie and "SameSite=Strict" in cookie
    status, _, page = _request(port, "GET", "/astraflow", ctx, {"Cookie": cookie.split(";")[0]})
    assert status == 200 and "HTTPS, with the run&#x27;s token" in page
    status, _, _ = _request(port, "GET", "/json/identity.json", ctx, {"Authorization": f"token {token}"})
    assert status == 200  # Dask's own endpoints are behind the token too


def test_no_endpoint_changes_state_even_with_the_token(exposed):
    port, ctx, token = exposed
    auth = {"Authorization": f"token {token}"}
    for path in PATHS:
        for method in WRITES:
            status, _, _ = _request(port, method, path, ctx, auth)
            assert status in (404, 405), f"{method} {path} answered {status}"


def test_the_astraflow_handlers_answer_get_only(tmp_path):
    for route in dashboard.routes(tmp_path):
        handler = route[1]
        for method in ("post", "put", "delete", "patch"):
            assert getattr(handler, method) is getattr(web.RequestHandler, method), f"{handler.__name__}.{method}"


def test_a_loopback_dashboard_says_so(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    files = run_tls(paths, TLSConfig())
    proc, port = _dashboard(paths, files, None)
    try:
        status, _, page = _request(port, "GET", "/astraflow")
        assert status == 200 and "access: this machine only (loopback)" in page
    finally:
        proc.stop()


def test_a_loopback_dashboard_needs_the_token_too_over_plain_http(tmp_path):
    """Other users of a shared node reach its loopback as well: the run's token, over HTTP
    (an SSH tunnel or the site's proxy in front), its cookie not marked Secure."""
    paths = RunPaths(tmp_path / "run").make()
    files = run_tls(paths, TLSConfig())
    token_file = dashboard_token(paths)
    proc = SchedulerProcess(paths, "127.0.0.1", 0, tls=files, dashboard_token_file=token_file, dashboard_https=False)
    address = proc.start()
    try:
        with Client(address, timeout=20, security=client_security(files)) as client:
            port = client.scheduler_info()["services"]["dashboard"]
        token = token_file.read_text().strip()
        for path in ("/astraflow", "/astraflow/api/status.json", "/status"):
            status, _, _ = _request(port, "GET", path)
            assert status in (401, 403), (path, status)
        status, headers, _ = _request(port, "GET", f"/astraflow?token={token}")
        assert status == 302 and "Secure" not in headers["Set-Cookie"] and "HttpOnly" in headers["Set-Cookie"]
        status, _, page = _request(port, "GET", "/astraflow", headers={"Authorization": f"token {token}"})
        assert status == 200 and "this machine only (127.0.0.1), with the run" in page
    finally:
        proc.stop()


def test_exposing_the_dashboard_without_tls_is_refused():
    with pytest.raises(ValueError, match="dashboard_host '10.1.2.3' is reachable from other machines"):
        ClusterConfig(dashboard_host="10.1.2.3", tls=TLSConfig(enabled=False))
    assert ClusterConfig(dashboard_host="10.1.2.3").tls.enabled
    assert ClusterConfig(dashboard_host="localhost", tls=TLSConfig(enabled=False))
