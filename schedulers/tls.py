"""Mutual TLS between the processes of a run: the files every component presents, and the
``cluster.tls`` settings that choose them (the run's own authority, the site's, or none).
The certificates themselves are made by ``astraflow.runtime.security``."""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


@dataclass(frozen=True)
class TLSFiles:
    """The PEM files with which a run's scheduler, workers and clients authenticate each other
    (mutual TLS): the authority's certificate, and the certificate + key every component presents.
    A worker given them joins only a scheduler holding a certificate from the same authority,
    and the scheduler admits only such workers and clients."""

    ca_file: Path
    cert_file: Path
    key_file: Path | None = None
    """None when `cert_file` holds the key too."""

    def args(self) -> list[str]:
        """The ``dask scheduler`` / ``dask worker`` options that turn TLS on with these files."""
        key = ["--tls-key", str(self.key_file)] if self.key_file else []
        return ["--tls-ca-file", str(self.ca_file), "--tls-cert", str(self.cert_file), *key]

    def to_json(self) -> dict[str, Any]:
        return {"ca_file": str(self.ca_file), "cert_file": str(self.cert_file),
                "key_file": str(self.key_file) if self.key_file else None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TLSFiles":
        key = data.get("key_file")
        return cls(Path(data["ca_file"]), Path(data["cert_file"]), Path(key) if key else None)


class _Encrypted(Exception):
    """A key file asked for a passphrase (no process of a run can type one)."""


def _no_passphrase() -> bytes:
    raise _Encrypted


def _why(err: OSError) -> str:
    """The reason of an ``ssl.SSLError`` (``key values mismatch``) or an ``OSError``, without its source line."""
    return re.sub(r"^\[[^]]*\]\s*|\s*\(_ssl\.c:\d+\)$", "", str(err)) if isinstance(err, ssl.SSLError) \
        else (err.strerror or str(err))


def pem_problem(ca_file: Path, cert_file: Path, key_file: Path | None) -> str | None:
    """Why the site's files cannot make the TLS contexts every component of a run builds from them
    (as Dask does: the authority to verify with, the certificate and its key to present), naming
    the field; None when they can. Found here, a bad file is a config error, not a scheduler
    that fails to start."""
    for name, path in (("ca_file", ca_file), ("cert_file", cert_file)):
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(path))
        except (ssl.SSLError, OSError) as err:
            what = "the site's CA certificate" if name == "ca_file" else "the certificate the run's components present"
            return f"cluster.tls.{name}: {path} holds no PEM certificate ({_why(err)}): point it at {what}"
    field, path = ("key_file", key_file) if key_file is not None else ("cert_file", cert_file)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(str(cert_file), str(key_file) if key_file else None,
                                                                password=_no_passphrase)
    except _Encrypted:
        return (f"cluster.tls.{field}: the private key in {path} is encrypted with a passphrase, which the run's "
                "processes cannot type: give it unencrypted, readable by you only (chmod 600)")
    except (ssl.SSLError, OSError) as err:
        why = "no PEM key read" if _why(err) == "PEM lib" else _why(err)
        if key_file is None:
            return (f"cluster.tls.cert_file: {path} holds no private key of its certificate ({why}): set key_file to "
                    "the certificate's private key, or append the key to cert_file")
        return (f"cluster.tls.key_file: {path} holds no private key of the certificate in {cert_file} ({why}): "
                "point key_file at that certificate's private key")
    refused = _handshake_problem(ca_file, cert_file, key_file)
    if refused:
        return (f"cluster.tls.cert_file: the certificate in {cert_file} is not accepted by the authority in "
                f"{ca_file} ({refused}): every component presents it and verifies its peers with ca_file, so "
                "point cert_file at a certificate that ca_file signed, or ca_file at its issuer")
    return None


def _handshake_problem(ca_file: Path, cert_file: Path, key_file: Path | None) -> str | None:
    """Why two of a run's components presenting ``cert_file`` and verifying with ``ca_file`` (as
    Dask does, mutual TLS without host names) would fail their handshake, e.g. a certificate
    another authority signed, or one expired; None when it succeeds. Done in memory."""
    sides = []
    for purpose in (ssl.Purpose.SERVER_AUTH, ssl.Purpose.CLIENT_AUTH):  # the client's, the server's (as Dask)
        ctx = ssl.create_default_context(purpose, cafile=str(ca_file))
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(str(cert_file), str(key_file) if key_file else None, password=_no_passphrase)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        sides.append((ctx.wrap_bio(incoming, outgoing, server_side=purpose == ssl.Purpose.CLIENT_AUTH),
                      incoming, outgoing))
    done = [False, False]
    for _ in range(16):  # a handshake takes a few round trips
        for i, (conn, _incoming, outgoing) in enumerate(sides):
            if not done[i]:
                try:
                    conn.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError as err:
                    return _why(err)
            sides[1 - i][1].write(outgoing.read())
        if all(done):
            try:  # the server judges the client's certificate after the client finished (TLS 1.3)
                sides[0][0].write(b"x")
                sides[1][1].write(sides[0][2].read())
                sides[1][0].read(1)
            except ssl.SSLError as err:
                return _why(err)
            return None
    return "the handshake did not complete"


class TLSConfig(BaseModel):
    """``cluster.tls``: how the run's Dask traffic is secured."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = True
    """Mutual TLS on every Dask connection (scheduler, workers, clients). ``false`` = plain TCP:
    anyone who can reach the scheduler's port can run code as you; only for a machine that is yours alone."""
    ca_file: Path | None = None
    """A site-provided CA certificate (PEM). None: the run creates its own authority."""
    cert_file: Path | None = None
    """A site-provided certificate (PEM) signed by `ca_file`, used by every component of the run."""
    key_file: Path | None = None
    """Its private key (PEM); None when `cert_file` holds the key too."""

    @model_validator(mode="after")
    def _site_files(self) -> "TLSConfig":
        given = {"ca_file": self.ca_file, "cert_file": self.cert_file}
        missing = [k for k, v in given.items() if v is None]
        if missing and (len(missing) == 1 or self.key_file is not None):
            raise ValueError(f"cluster.tls: site certificates need ca_file and cert_file (key_file if separate); "
                             f"{', '.join(missing)} missing: set it, or remove the others to let the run create "
                             "its own")
        if not self.enabled and self.ca_file is not None:
            raise ValueError("cluster.tls: certificate files are set but enabled is false: remove them or enable TLS")
        for name in ("ca_file", "cert_file", "key_file"):
            p = getattr(self, name)
            if p is not None and not p.is_file():
                raise ValueError(f"cluster.tls.{name}: {p} is not a readable file: point it at a PEM file")
        if self.ca_file is not None and self.cert_file is not None:
            problem = pem_problem(self.ca_file, self.cert_file, self.key_file)
            if problem:
                raise ValueError(problem)
        return self

    @property
    def site_provided(self) -> bool:
        return self.ca_file is not None
