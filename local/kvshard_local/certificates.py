"""Self-signed certificates for the etcd that tests and the local cluster run, made at start.

Production etcd talks TLS with client-certificate auth (the chart's etcd, cert-manager or a
user's PKI), so the etcd the tests and ``kvshard up`` start does too: the TLS path is the path every
test takes, not an option nobody runs. Each :func:`make_etcd_certificates` call makes a fresh CA
and, signed by it, one certificate etcd serves (clients and peers) and one client certificate the
kvshard components present. Keys are ECDSA P-256 (fast to make, accepted by etcd and gRPC) and are
written readable by their owner only.

    certs = make_etcd_certificates(Path("/tmp/etcd-tls"))
    etcd --cert-file certs.server_cert ... --trusted-ca-file certs.ca
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
"""What the etcd certificate names: clients reach a loopback etcd by IP, some tools by name."""
VALID_DAYS = 30


@dataclasses.dataclass(frozen=True)
class EtcdCertificates:
    """PEM files of one etcd's CA, server (and peer) certificate and client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvshard"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, *, private: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _issue(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
           issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool, usages: Sequence[x509.ObjectIdentifier] = (),
           hosts: Sequence[str] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, key_cert_sign=False, crl_sign=False,
            content_commitment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_etcd_certificates(folder: Path, *, hosts: Sequence[str] = LOOPBACK_HOSTS,
                           client_name: str = "kvshard") -> EtcdCertificates:
    """A new CA in ``folder`` (``ca.crt``; its key is not kept: nothing else is ever signed by it),
    the server certificate etcd serves to clients and peers for ``hosts`` (``server.crt``/``.key``,
    server and client usage, since members also dial each other) and a client certificate whose
    common name is ``client_name`` (``client.crt``/``.key``). Files that exist are replaced."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"kvshard etcd CA {os.urandom(4).hex()}")
    ca_cert = _issue(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _issue(_name("etcd"), server_key, ca_name, ca_key, ca=False, hosts=hosts,
                         usages=(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH))
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _issue(_name(client_name), client_key, ca_name, ca_key, ca=False,
                         usages=(ExtendedKeyUsageOID.CLIENT_AUTH,))
    certs = EtcdCertificates(ca=folder / "ca.crt", server_cert=folder / "server.crt",
                             server_key=folder / "server.key", client_cert=folder / "client.crt",
                             client_key=folder / "client.key")
    _write(certs.ca, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(certs.server_cert, server_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(certs.server_key, _pem_key(server_key), private=True)
    _write(certs.client_cert, client_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(certs.client_key, _pem_key(client_key), private=True)
    return certs
