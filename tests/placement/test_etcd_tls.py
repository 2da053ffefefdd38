"""etcd over TLS with client-certificate auth, against a real etcd: what works, and what each
mistake (no CA, the wrong CA, no client certificate, the wrong name, plaintext) is reported as."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard.etcd_tls import EtcdTLS, EtcdTLSConfigError, files_problem
from kvshard_local.certificates import EtcdCertificates, make_etcd_certificates
from kvshard_local.testing_servers import EtcdServer

pytestmark = pytest.mark.slow
PLACEMENT = ps.Placement(generation=1, assignment={0: ("pod-a",)}, item_clusters={"i": 0}, pods=("pod-a",), model="m")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> EtcdCertificates:
    """Certificates from another CA: etcd never signed nor trusts them."""
    return make_etcd_certificates(tmp_path_factory.mktemp("stranger"))


def certs(server: EtcdServer) -> EtcdCertificates:
    assert server.certificates is not None
    return server.certificates


async def test_the_test_etcd_serves_tls_and_a_client_with_ca_and_certificate_publishes(
        etcd_server: EtcdServer) -> None:
    assert etcd_server.url.startswith("https://")
    async with etcd_server.store(timeout=3) as store:
        await store.publish("ns", "tls", PLACEMENT, expected=0)
        assert await store.read_current("ns", "tls") == PLACEMENT


async def test_a_host_name_endpoint_is_resolved_and_verified_against_the_certificate(
        etcd_server: EtcdServer) -> None:
    by_name = f"localhost:{etcd_server.client_port}"
    async with etcd_store.EtcdStore([by_name], tls=etcd_server.client_tls, timeout=3, attempts=1) as store:
        await store.ping()
    async with etcd_store.EtcdStore([by_name, etcd_server.endpoint], tls=etcd_server.client_tls, timeout=3,
                                    attempts=1) as store:
        await store.ping()


async def test_etcd_refuses_a_client_without_a_certificate_and_the_error_says_why(etcd_server: EtcdServer) -> None:
    ca_only = EtcdTLS.from_files(certs(etcd_server).ca, setting="KVSHARD_ROUTER_ETCD_*")
    with pytest.raises(etcd_store.EtcdTLSError, match="requires a client certificate.*got no client certificate"):
        async with etcd_store.EtcdStore([etcd_server.endpoint], tls=ca_only, timeout=3, attempts=1) as store:
            await store.ping()


async def test_etcd_refuses_a_client_certificate_of_another_ca(etcd_server: EtcdServer,
                                                               stranger: EtcdCertificates) -> None:
    foreign = EtcdTLS.from_files(certs(etcd_server).ca, stranger.client_cert, stranger.client_key)
    with pytest.raises(etcd_store.EtcdTLSError, match=f"requires a client certificate.*{stranger.client_cert}"):
        async with etcd_store.EtcdStore([etcd_server.endpoint], tls=foreign, timeout=3, attempts=1) as store:
            await store.ping()


async def test_the_wrong_ca_is_a_tls_error_naming_the_ca_not_an_outage(etcd_server: EtcdServer,
                                                                      stranger: EtcdCertificates) -> None:
    wrong_ca = EtcdTLS.from_files(stranger.ca, certs(etcd_server).client_cert, certs(etcd_server).client_key,
                                  setting="KVSHARD_ROUTER_ETCD_*")
    with pytest.raises(etcd_store.EtcdTLSError) as caught:
        async with etcd_store.EtcdStore([etcd_server.endpoint], tls=wrong_ca, timeout=3, attempts=1) as store:
            await store.ping()
    assert not isinstance(caught.value, etcd_store.EtcdUnavailableError)
    assert "not signed by the CA" in str(caught.value) and str(stranger.ca) in str(caught.value)
    assert "KVSHARD_ROUTER_ETCD_*" in str(caught.value)


async def test_a_certificate_that_does_not_name_the_host_fails_verification(etcd_server: EtcdServer) -> None:
    tls = etcd_server.client_tls
    assert tls is not None
    renamed = dataclasses.replace(tls, server_name="etcd.example")
    with pytest.raises(etcd_store.EtcdTLSError, match="does not name 'etcd.example'"):
        async with etcd_store.EtcdStore([etcd_server.endpoint], tls=renamed, timeout=3, attempts=1) as store:
            await store.ping()


async def test_a_plaintext_client_at_a_tls_etcd_is_told_to_give_the_ca(etcd_server: EtcdServer) -> None:
    with pytest.raises(etcd_store.EtcdUnavailableError, match="if it serves TLS, give its CA"):
        async with etcd_store.EtcdStore([etcd_server.endpoint], timeout=3, attempts=1) as store:
            await store.ping()


async def test_a_tls_client_at_a_plaintext_etcd_is_a_tls_error() -> None:
    with EtcdServer(tls=False) as plain, EtcdServer() as secured:
        assert plain.url.startswith("http://") and plain.client_tls is None
        with pytest.raises(etcd_store.EtcdTLSError, match="does etcd serve TLS"):
            async with etcd_store.EtcdStore([plain.endpoint], tls=secured.client_tls, timeout=3, attempts=1) as s:
                await s.ping()
        async with plain.store(timeout=3) as store:  # plaintext still works where etcd serves it
            await store.ping()


def test_tls_settings_that_cannot_work_are_refused_before_connecting(tmp_path: Path,
                                                                     stranger: EtcdCertificates) -> None:
    assert EtcdTLS.from_files(None) is None  # nothing given: plaintext
    with pytest.raises(EtcdTLSConfigError, match="without the CA file"):
        EtcdTLS.from_files(None, stranger.client_cert, stranger.client_key, setting="KVSHARD_SIDECAR_ETCD_*")
    with pytest.raises(EtcdTLSConfigError, match="come together"):
        EtcdTLS.from_files(stranger.ca, stranger.client_cert, None)
    with pytest.raises(EtcdTLSConfigError, match=f"cannot read the etcd CA file {tmp_path / 'nope.crt'}"):
        EtcdTLS.from_files(tmp_path / "nope.crt")
    (tmp_path / "garbage.crt").write_text("not a certificate")
    with pytest.raises(EtcdTLSConfigError, match="not a PEM certificate"):
        EtcdTLS.from_files(tmp_path / "garbage.crt")
    with pytest.raises(EtcdTLSConfigError, match="not a PEM private key"):
        EtcdTLS.from_files(stranger.ca, stranger.client_cert, stranger.client_cert)
    assert files_problem(stranger.ca, None, None) is None  # CA only: TLS without client-cert auth


def test_a_secret_without_ca_crt_is_refused_naming_the_secret() -> None:
    with pytest.raises(EtcdTLSConfigError, match="Secret ns/etcd-client has no key ca.crt.*tls.crt, tls.key"):
        EtcdTLS.from_secret({"tls.crt": b"x", "tls.key": b"y"}, secret="ns/etcd-client")


def test_certificates_are_made_fresh_with_private_keys_readable_by_the_owner_only(tmp_path: Path) -> None:
    one, two = make_etcd_certificates(tmp_path / "one"), make_etcd_certificates(tmp_path / "two")
    assert one.ca.read_bytes() != two.ca.read_bytes()
    for key in (one.server_key, one.client_key):
        assert key.stat().st_mode & 0o077 == 0
    assert repr(EtcdTLS.from_files(one.ca, one.client_cert, one.client_key)).count("PRIVATE") == 0
