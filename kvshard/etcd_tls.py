"""TLS to etcd: what a component trusts and presents, and what a failed handshake means.

etcd holds where every user's history KV lives, so it serves TLS and asks each client for a
certificate (client-cert auth). Every kvshard component connects the same way: the CA that signed
etcd's server certificate, and a client certificate with its key. The router and the sidecars read
them from files (a mounted Secret; ``--etcd-ca-file``, ``--etcd-cert-file``, ``--etcd-key-file``), the
operator from the Secret ``spec.etcd.tls.secretRef`` names (keys ``ca.crt``, ``tls.crt``, ``tls.key``:
what cert-manager writes).

gRPC reports every failed handshake as "unavailable", the same as a stopped etcd, so a component
with the wrong CA would retry forever saying etcd is down. :func:`diagnose` reads gRPC's details and
names the actual mistake instead (wrong CA, a certificate that does not name the host, a client
certificate etcd refused, a plaintext client at a TLS etcd). Pure: no etcd3aio, no gRPC here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping, Sequence
from pathlib import Path

CA_KEY = "ca.crt"
CERT_KEY = "tls.crt"
KEY_KEY = "tls.key"
_CERT_PEM = b"-----BEGIN CERTIFICATE-----"
_KEY_PEM = b"PRIVATE KEY-----"


class EtcdTLSConfigError(ValueError):
    """The TLS settings cannot work (no CA, half a key pair, unreadable or non-PEM files); raised
    before any connection, naming what is wrong."""


@dataclasses.dataclass(frozen=True)
class EtcdTLS:
    """What a client trusts (``ca``) and presents (``cert`` + ``key``, for client-cert auth), as PEM.

    ``server_name`` is the name etcd's certificate must carry; empty means the host of the first
    endpoint. ``source`` says where the material came from, for error messages.
    """

    ca: bytes = dataclasses.field(repr=False)
    cert: bytes | None = dataclasses.field(default=None, repr=False)
    key: bytes | None = dataclasses.field(default=None, repr=False)
    server_name: str = ""
    source: str = "the TLS settings"

    def __post_init__(self) -> None:
        if not self.ca.strip():
            raise EtcdTLSConfigError(f"{self.source}: no CA certificate, so etcd's server certificate cannot be "
                                     "verified; give the CA that signed it")
        if _CERT_PEM not in self.ca:
            raise EtcdTLSConfigError(f"{self.source}: the CA is not a PEM certificate (-----BEGIN CERTIFICATE-----)")
        if (self.cert is None) != (self.key is None):
            missing = "key" if self.key is None else "certificate"
            raise EtcdTLSConfigError(f"{self.source}: a client certificate needs its key and a key its "
                                     f"certificate; the {missing} is missing")
        if self.cert is not None and _CERT_PEM not in self.cert:
            raise EtcdTLSConfigError(f"{self.source}: the client certificate is not PEM (-----BEGIN CERTIFICATE-----)")
        if self.key is not None and _KEY_PEM not in self.key:
            raise EtcdTLSConfigError(f"{self.source}: the client key is not a PEM private key")

    @classmethod
    def from_files(cls, ca_file: Path | None, cert_file: Path | None = None, key_file: Path | None = None,
                   *, server_name: str = "", setting: str = "etcd") -> EtcdTLS | None:
        """TLS from PEM files, ``None`` when no file is given (plaintext). ``setting`` prefixes the
        messages (e.g. the env variable prefix), so an error names what to fix."""
        problem = files_problem(ca_file, cert_file, key_file)
        if problem:
            raise EtcdTLSConfigError(f"{setting}: {problem}")
        if ca_file is None:
            return None

        def read(path: Path | None, what: str) -> bytes | None:
            if path is None:
                return None
            try:
                return path.read_bytes()
            except OSError as exc:
                raise EtcdTLSConfigError(f"{setting}: cannot read the etcd {what} {path}: "
                                         f"{exc.strerror or exc}") from None

        ca = read(ca_file, "CA file")
        assert ca is not None
        return cls(ca=ca, cert=read(cert_file, "client certificate"), key=read(key_file, "client key"),
                   server_name=server_name,
                   source=f"{setting} (CA {ca_file}" + (f", certificate {cert_file})" if cert_file else ")"))

    @classmethod
    def from_secret(cls, data: Mapping[str, bytes], *, secret: str, server_name: str = "") -> EtcdTLS:
        """TLS from a Secret's data (``ca.crt``, and ``tls.crt`` + ``tls.key`` for client-cert auth)."""
        if CA_KEY not in data:
            raise EtcdTLSConfigError(f"Secret {secret} has no key {CA_KEY}: the CA that signed etcd's server "
                                     f"certificate (keys: {', '.join(sorted(data)) or 'none'})")
        return cls(ca=data[CA_KEY], cert=data.get(CERT_KEY), key=data.get(KEY_KEY), server_name=server_name,
                   source=f"Secret {secret}")

    def channel_args(self, endpoints: Sequence[str]) -> dict[str, bytes | str | None]:
        """Keyword arguments of ``etcd3aio.Etcd3Client`` for these credentials."""
        return {"ca_cert": self.ca, "cert_chain": self.cert, "cert_key": self.key,
                "tls_server_name": self.server_name or endpoint_host(endpoints[0])}


def files_problem(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> str | None:
    """Why these TLS file settings cannot work, or ``None``: a client certificate without the CA
    (nothing would verify etcd), or half a key pair."""
    if (cert_file is None) != (key_file is None):
        return "the client certificate and key files come together (one is missing)"
    if ca_file is None and cert_file is not None:
        return ("a client certificate without the CA file: etcd's server certificate could not be verified; "
                "give the CA that signed it (the Secret's ca.crt)")
    return None


def endpoint_host(endpoint: str) -> str:
    """The host of ``host:port`` (``[v6]:port`` too)."""
    host = endpoint.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def diagnose(details: str, tls: EtcdTLS | None, endpoints: Sequence[str]) -> str | None:
    """What a gRPC failure says about TLS, as a message that names the fix; ``None`` when it is not a
    TLS problem (etcd down, timeouts). With ``tls`` None a plaintext client may have met a TLS etcd,
    which gRPC reports only as a closed socket: that is a hint, not a certainty (see the caller)."""
    where = ",".join(endpoints)
    if tls is None:
        if "Socket closed" in details or "WRONG_VERSION_NUMBER" in details:
            return (f"etcd at {where} closed a plaintext connection: if it serves TLS, give its CA, a client "
                    "certificate and key")
        return None
    name = tls.server_name or endpoint_host(endpoints[0])
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"TLS to etcd at {where} failed: its server certificate is not signed by the CA from "
                f"{tls.source}; give the CA that signed etcd's certificate")
    if "Hostname Verification" in details or "Peer name" in details:
        return (f"TLS to etcd at {where} failed: its server certificate does not name {name!r}; connect by a "
                "name the certificate carries or set the etcd server name")
    if any(s in details for s in ("BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "TSI_DATA_CORRUPTED",
                                  "UNKNOWN_CA")):
        given = "the client certificate from " + tls.source if tls.cert else "no client certificate"
        return (f"etcd at {where} refused the TLS connection: it requires a client certificate signed by a CA "
                f"it trusts, and got {given}")
    if "WRONG_VERSION_NUMBER" in details or "handshake" in details.lower():
        return f"TLS to etcd at {where} failed ({details.strip()[:200]}); does etcd serve TLS on this port?"
    return None
