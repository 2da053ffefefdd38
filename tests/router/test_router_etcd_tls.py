"""The router reaches etcd over TLS with its client certificate from file settings; given the wrong
CA it is not ready and says why, and settings that cannot work stop it at start."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from router_helpers import eventually, publish, running_router

from kvshard.cli import main
from kvshard.placement_schema import Placement
from kvshard.settings import SettingsError, from_sources
from kvshard_local.certificates import EtcdCertificates, make_etcd_certificates
from kvshard_local.testing_servers import EtcdServer
from kvshard_router.settings import ENV_PREFIX, RouterSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> EtcdCertificates:
    return make_etcd_certificates(tmp_path_factory.mktemp("stranger"))


async def get(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json()


async def test_the_router_follows_placement_over_tls_with_its_client_certificate(etcd_server: EtcdServer) -> None:
    await publish(etcd_server, "default/tls", Placement(1, {0: ("a",)}, {"i": 0}, pods=("a",)), {})
    async with running_router(etcd_server, "default/tls") as (url, router):
        assert router.settings.etcd_ca_file is not None  # the TLS path, not plaintext
        await eventually(lambda: router.state.generation == 1, what="generation 1 over TLS")
        status, view = await get(url + "/v1/placement")
        assert status == 200 and view["generation"] == 1 and view["etcd"] == {
            "endpoints": [etcd_server.endpoint], "errors": {}}


async def test_the_router_with_the_wrong_ca_is_not_ready_and_says_it_is_the_ca(
        etcd_server: EtcdServer, stranger: EtcdCertificates) -> None:
    await publish(etcd_server, "default/wrong-ca", Placement(1, {0: ("a",)}, {"i": 0}, pods=("a",)), {})
    async with running_router(etcd_server, "default/wrong-ca", etcd_ca_file=stranger.ca) as (url, router):
        await eventually(lambda: bool(router.follower and router.follower.errors.get("placement")),
                         what="the follower reports its etcd error")
        status, body = await get(url + "/readyz")
        message = str(body)
        assert status == 503 and "not signed by the CA" in message and str(stranger.ca) in message
        assert router.state.generation == 0


def test_router_serve_refuses_a_client_certificate_without_the_ca(
        stranger: EtcdCertificates, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["router", "serve", "--etcd-endpoints", "127.0.0.1:2379", "--cacheshard", "default/x",
                 "--etcd-cert-file", str(stranger.client_cert), "--etcd-key-file", str(stranger.client_key)])
    assert code == 2
    assert "without the CA file" in capsys.readouterr().err


def test_router_serve_stops_at_an_unreadable_ca_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["router", "serve", "--etcd-endpoints", "127.0.0.1:2379", "--cacheshard", "default/x",
                 "--etcd-ca-file", str(tmp_path / "missing.crt")])
    assert code == 2
    assert f"cannot read the etcd CA file {tmp_path / 'missing.crt'}" in capsys.readouterr().err


def test_the_tls_files_come_from_env_like_the_other_etcd_settings(stranger: EtcdCertificates) -> None:
    environ = {f"{ENV_PREFIX}ETCD_CA_FILE": str(stranger.ca), f"{ENV_PREFIX}ETCD_CERT_FILE": str(stranger.client_cert),
               f"{ENV_PREFIX}ETCD_KEY_FILE": str(stranger.client_key), f"{ENV_PREFIX}ETCD_SERVER_NAME": "etcd.svc"}
    settings = from_sources(RouterSettings, None, ENV_PREFIX, environ)
    assert (settings.etcd_ca_file, settings.etcd_cert_file, settings.etcd_key_file) == (
        stranger.ca, stranger.client_cert, stranger.client_key)
    tls = settings.etcd_tls()
    assert tls is not None and tls.server_name == "etcd.svc" and tls.ca == stranger.ca.read_bytes()
    with pytest.raises(SettingsError, match="come together"):
        from_sources(RouterSettings, None, ENV_PREFIX, {f"{ENV_PREFIX}ETCD_CERT_FILE": str(stranger.client_cert)})
