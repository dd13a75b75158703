"""Mutual TLS of a run's Dask traffic, on real scheduler and worker processes: the run's
certificates let a client and a worker in; no certificate, or one from another authority, is
refused."""

from __future__ import annotations

import json
import socket
import ssl
import stat
import subprocess
import time

import pytest
from distributed import Client

from schedulers.tls import TLSConfig
from astraflow.runtime.cluster import SchedulerProcess, connected_workers, worker_env
from astraflow.runtime.security import client_security, create_run_certificates, run_tls, security_for_address
from schedulers import LocalScheduler, Partition, worker_command
from storage.paths import RunPaths


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def tls_scheduler(tmp_path):
    """(run paths, TLS files, tls:// address) of a real scheduler started as a run starts it."""
    paths = RunPaths(tmp_path / "run").make()
    files = run_tls(paths, TLSConfig())
    proc = SchedulerProcess(paths, dashboard_port=0, tls=files)
    address = proc.start()
    yield paths, files, address
    proc.stop()


def test_the_run_creates_owner_only_certificates(tmp_path):
    files = create_run_certificates(tmp_path / "security")
    assert _mode(tmp_path / "security") == 0o700
    for f in (files.ca_file, files.cert_file, files.key_file):
        assert _mode(f) == 0o600, f
    assert b"PRIVATE KEY" in files.key_file.read_bytes() and b"PRIVATE KEY" not in files.cert_file.read_bytes()
    assert not any("key" in p.name and p != files.key_file for p in (tmp_path / "security").iterdir()), \
        "the authority's key is never written"
    first = files.cert_file.read_bytes()
    again = create_run_certificates(tmp_path / "security")  # a restart makes a new pair
    assert again.cert_file.read_bytes() != first


def test_a_client_needs_the_runs_certificate(tls_scheduler, tmp_path):
    paths, files, address = tls_scheduler
    assert address.startswith("tls://")
    with Client(address, timeout=20, security=client_security(files)) as client:
        assert client.submit(lambda x: x + 1, 1, pure=False) is not None  # a connected client
        assert client.scheduler_info()["address"] == address
    with Client(address, timeout=20, security=security_for_address(paths, address)):
        pass  # what other clients of the run use: the files named in security/tls.json

    assert _refusal_without_certificate(address)  # the alert (CERTIFICATE_REQUIRED) or a closed connection
    with pytest.raises((OSError, TimeoutError, ValueError)):  # plain TCP to the same port
        Client(address.replace("tls://", "tcp://"), timeout=3)
    other = create_run_certificates(tmp_path / "other")
    with pytest.raises((OSError, TimeoutError)):  # a certificate from another authority
        Client(address, timeout=3, security=client_security(other))


def _refusal_without_certificate(address: str) -> str:
    """How the scheduler refuses a TLS client that presents no certificate (the client trusts
    any server certificate, so only the scheduler's own check can stop it); "" if it does not."""
    host, port = address.removeprefix("tls://").rsplit(":", 1)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, int(port)), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as conn:
            conn.sendall(b"\0" * 8)
            conn.recv(1)  # a server that accepted us waits for a whole message: this times out
    except (ssl.SSLError, ConnectionError) as err:  # the alert, or the connection closed on us
        return str(err) or type(err).__name__
    except TimeoutError:
        return ""
    return "closed"


def _worker(address: str, name: str, log, tls=None) -> subprocess.Popen:
    cmd = worker_command(address, name, {}, host="127.0.0.1", death_timeout=8, tls=tls)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env())


def test_only_workers_with_the_runs_certificate_join(tls_scheduler, tmp_path):
    paths, files, address = tls_scheduler
    other = create_run_certificates(tmp_path / "other")
    with Client(address, timeout=20, security=client_security(files)) as client:
        procs = {
            "good": _worker(address, "good", open(tmp_path / "good.log", "wb"), tls=files),
            "none": _worker(address, "none", open(tmp_path / "none.log", "wb")),
            "other": _worker(address, "other", open(tmp_path / "other.log", "wb"), tls=other),
        }
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                names = {w["name"] for w in connected_workers(client).values()}
                if "good" in names and procs["none"].poll() is not None and procs["other"].poll() is not None:
                    break
                time.sleep(0.2)
            assert names == {"good"}
            # refused workers give up after their death timeout instead of joining
            assert procs["none"].poll() not in (None, 0) and procs["other"].poll() not in (None, 0)
        finally:
            for p in procs.values():
                p.terminate()
                p.wait(10)


def test_local_workers_of_a_run_get_its_certificates(tls_scheduler, tmp_path):
    paths, files, address = tls_scheduler
    sched = LocalScheduler(tmp_path / "logs", death_timeout=20, tls=files)
    try:
        (ref,) = sched.submit(Partition(name="pool", role="trainer"), address, 1)
        with Client(address, timeout=20, security=client_security(files)) as client:
            deadline = time.monotonic() + 60
            while ref.worker_name not in {w["name"] for w in connected_workers(client).values()}:
                assert time.monotonic() < deadline, ref.log.read_text()
                time.sleep(0.2)
    finally:
        sched.cancel([ref.job_id])
        sched.close()


def test_tls_off_is_explicit_and_warns(tmp_path, caplog):
    paths = RunPaths(tmp_path / "run").make()
    with caplog.at_level("WARNING", logger="astraflow.security"):
        assert run_tls(paths, TLSConfig(enabled=False)) is None
    assert "plain TCP" in caplog.text


def test_site_certificates_are_used_as_given(tmp_path):
    site = create_run_certificates(tmp_path / "site")
    paths = RunPaths(tmp_path / "run").make()
    files = run_tls(paths, TLSConfig(ca_file=site.ca_file, cert_file=site.cert_file, key_file=site.key_file))
    assert files == site
    assert json.loads((paths.root / "security" / "tls.json").read_text())["cert_file"] == str(site.cert_file)
    assert not (paths.root / "security" / "run-key.pem").exists()


@pytest.mark.parametrize("fields, message", [
    ({"ca_file": "CA"}, "cert_file missing"),
    ({"cert_file": "CERT"}, "ca_file missing"),
    ({"key_file": "KEY"}, "ca_file, cert_file missing"),
    ({"ca_file": "CA", "cert_file": "CERT", "enabled": False}, "enabled is false"),
    ({"ca_file": "nope.pem", "cert_file": "CERT"}, "is not a readable file"),
])
def test_bad_tls_settings_name_the_fix(tmp_path, fields, message):
    site = create_run_certificates(tmp_path / "site")
    names = {"CA": site.ca_file, "CERT": site.cert_file, "KEY": site.key_file}
    with pytest.raises(ValueError, match=message):
        TLSConfig(**{k: names.get(v, v) for k, v in fields.items()})


def _encrypted_key(key_file, out):
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(key_file.read_bytes(), None)
    out.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"secret")))
    return out


@pytest.mark.parametrize("fields, message", [
    ({"ca_file": "JUNK", "cert_file": "CERT", "key_file": "KEY"},
     r"cluster.tls.ca_file: .*/junk.pem holds no PEM certificate \(no certificate or crl found\): point it at"),
    ({"ca_file": "CA", "cert_file": "KEY", "key_file": "KEY"}, r"cluster.tls.cert_file: .* holds no PEM certificate"),
    ({"ca_file": "CA", "cert_file": "CERT", "key_file": "JUNK"},
     r"cluster.tls.key_file: .*/junk.pem holds no private key of the certificate in .*: point key_file at"),
    ({"ca_file": "CA", "cert_file": "CERT", "key_file": "OTHER"}, r"cluster.tls.key_file: .*\(key values mismatch\)"),
    ({"ca_file": "CA", "cert_file": "CERT", "key_file": "ENCRYPTED"},
     r"cluster.tls.key_file: the private key in .* is encrypted with a passphrase"),
    ({"ca_file": "CA", "cert_file": "CERT"}, r"cluster.tls.cert_file: .* holds no private key of its certificate"),
    ({"ca_file": "OTHER_CA", "cert_file": "CERT", "key_file": "KEY"},
     r"cluster.tls.cert_file: the certificate in .*/site/run.pem is not accepted by the authority in .*/other/ca.pem "
     r"\(certificate verify failed: .*\).*point cert_file at a certificate that ca_file signed"),
])
def test_site_files_that_do_not_load_are_refused_naming_the_field(tmp_path, fields, message):
    """Files that exist but would not make a TLS context: refused when the config loads, not when
    the scheduler starts with them."""
    site, other = create_run_certificates(tmp_path / "site"), create_run_certificates(tmp_path / "other")
    (tmp_path / "junk.pem").write_text("garbage\n")
    names = {"CA": site.ca_file, "CERT": site.cert_file, "KEY": site.key_file, "JUNK": tmp_path / "junk.pem",
             "OTHER": other.key_file, "OTHER_CA": other.ca_file, "ENCRYPTED": _encrypted_key(site.key_file, tmp_path / "enc.pem")}
    with pytest.raises(ValueError, match=message):
        TLSConfig(**{k: names[v] for k, v in fields.items()})
    bundle = tmp_path / "bundle.pem"  # a certificate file that holds its key too
    bundle.write_bytes(site.cert_file.read_bytes() + site.key_file.read_bytes())
    TLSConfig(ca_file=site.ca_file, cert_file=bundle)


def test_a_scheduler_on_a_named_interface_starts_with_tls(tmp_path):
    """``cluster.scheduler_interface`` (ib0 on a cluster; lo here) with TLS on: Dask refuses an
    interface together with the TLS protocol, so the scheduler listens on the interface's address."""
    paths = RunPaths(tmp_path / "run").make()
    files = run_tls(paths, TLSConfig())
    proc = SchedulerProcess(paths, dashboard_port=0, interface="lo", tls=files)
    try:
        address = proc.start()
        assert address.startswith("tls://127.")
        with Client(address, timeout=20, security=client_security(files)) as client:
            assert client.scheduler_info()["address"] == address
    finally:
        proc.stop()
    with pytest.raises(ValueError, match=r"cluster.scheduler_interface: 'nope0' is no network interface .*lo"):
        SchedulerProcess(paths, dashboard_port=0, interface="nope0", tls=files)


def test_a_scheduler_that_cannot_start_says_why_in_its_error(tmp_path):
    """A host that does not resolve: the error quotes the scheduler log's cause, not only its code."""
    paths = RunPaths(tmp_path / "run").make()
    paths.log("scheduler").write_text("Traceback (most recent call last):\nValueError: an earlier incarnation's\n")
    with pytest.raises(RuntimeError, match=r"exited with code 1 while starting: socket\.gaierror: "):
        SchedulerProcess(paths, dashboard_port=0, host="no.such.host.invalid").start()
