"""Runtime room: mutual TLS for every Dask connection of a run.

Anyone who can reach a plain-TCP Dask scheduler can submit functions that run as the run's
owner. So by default each run gets its own certificate authority, created at start with
``cryptography``, and one certificate signed by it that the scheduler, every worker (local and
Slurm) and every client present: Dask then requires TLS on every connection and each side
refuses a peer without a certificate from that authority (``ssl.CERT_REQUIRED``; host names are
not checked, the run's own authority is the identity).

The files live in ``<run>/security/`` (directory 0700, files 0600): Slurm workers on other nodes
read them from the shared run directory, like everything else of the run. The authority's
private key is never written: once the certificate is signed, nobody, the run included, can
mint another one. A new pair is made at every start, so a resumed run also revokes the old one.

Sites with their own PKI set ``cluster.tls.ca_file``/``cert_file``/``key_file`` instead.
``cluster.tls.enabled: false`` turns TLS off (plain TCP), with a warning.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import secrets
from pathlib import Path

from typing import TYPE_CHECKING

from schedulers.command import TLSFiles
from storage.atomic import read_json_object, write_json
from storage.paths import RunPaths

if TYPE_CHECKING:
    from schedulers.tls import TLSConfig

log = logging.getLogger("astraflow.security")

#: how long a run's certificates are valid: longer than any Slurm walltime a site allows
VALIDITY = datetime.timedelta(days=400)


def dashboard_token(paths: RunPaths) -> Path:
    """A new random token for the run's dashboard, in an owner-only file; returns the file."""
    f = paths.dashboard_token
    paths.security.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private_write(f, secrets.token_urlsafe(32).encode())
    return f


def _private_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by the owner only, from the first byte."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def create_run_certificates(directory: Path, common_name: str = "astraflow-run") -> TLSFiles:
    """A fresh authority and one certificate signed by it, written to `directory` (0700).

    ECDSA P-256 keys: quick to make and to handshake with. The certificate is good for both ends
    of a connection (server and client authentication), as every component is both.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    files = TLSFiles(ca_file=directory / "ca.pem", cert_file=directory / "run.pem", key_file=directory / "run-key.pem")
    _private_write(files.ca_file, ca.public_bytes(pem))
    _private_write(files.cert_file, leaf.public_bytes(pem))
    _private_write(files.key_file, key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return files


def run_tls(paths: RunPaths, cfg: TLSConfig) -> TLSFiles | None:
    """The TLS files of a run that is starting (site-provided or newly created); None with a
    warning when TLS is turned off."""
    if not cfg.enabled:
        log.warning("cluster.tls.enabled is false: the run's Dask traffic is plain TCP, and anyone who can reach "
                    "its scheduler port can run code as %s", os.environ.get("USER", "you"))
        return None
    paths.security.mkdir(mode=0o700, parents=True, exist_ok=True)
    if cfg.site_provided:
        files = TLSFiles(ca_file=cfg.ca_file.absolute(), cert_file=cfg.cert_file.absolute(),  # type: ignore[union-attr]
                         key_file=cfg.key_file.absolute() if cfg.key_file else None)
    else:
        files = create_run_certificates(paths.security)
    write_json(paths.tls_record, files.to_json())  # how clients of the run find them
    return files


def client_security(files: TLSFiles | None):
    """The ``distributed.Security`` of a client of the run (None: plain TCP)."""
    if files is None:
        return None
    from distributed import Security

    key = str(files.key_file) if files.key_file else None
    return Security(require_encryption=True, tls_ca_file=str(files.ca_file),
                    tls_client_cert=str(files.cert_file), tls_client_key=key)


def security_for_address(paths: RunPaths, address: str):
    """The Security a client needs for a run's scheduler at `address`: its TLS files when the
    address is ``tls://`` (read from the run's ``security/tls.json``), else None."""
    if not address.startswith("tls://"):
        return None
    record = read_json_object(paths.tls_record)
    return client_security(TLSFiles.from_json(record))
