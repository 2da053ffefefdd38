"""The operator reaches etcd over TLS with the Secret ``spec.etcd.tls.secretRef`` names: a missing
Secret or CA is an invalid spec, a wrong CA is ``Degraded`` with the reason, the right one publishes."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from emulated import ETCD_TLS_SECRET, etcd_spec

from kvshard.etcd_tls import CA_KEY, CERT_KEY, KEY_KEY
from kvshard_local.certificates import make_etcd_certificates
from kvshard_local.testing_servers import EtcdServer
from kvshard_operator import conditions as cond
from kvshard_operator import warmth
from kvshard_operator.kube import SecretError
from kvshard_operator.reconcile import Outcome, PodView, ShardState, reconcile
from kvshard_operator.settings import Settings

pytestmark = pytest.mark.slow
NS = "default"
SETTINGS = Settings(etcd_timeout_seconds=2, retry_backoff_seconds=0.1)
LOG = logging.getLogger("test_etcd_tls")


def condition(outcome: Outcome, type_: str) -> dict[str, Any]:
    return cond.get(outcome.status["conditions"], type_) or {}


async def test_reconcile_publishes_over_tls_only_with_the_right_secret(
        etcd_server: EtcdServer, catalog_file: Path, tmp_path: Path) -> None:
    secrets: dict[str, Mapping[str, bytes]] = {}

    def read_secret(namespace: str, name: str) -> Mapping[str, bytes]:
        if (namespace, name) not in {(NS, n) for n in secrets}:
            raise SecretError(f"Secret {namespace}/{name}: Not Found")
        return secrets[name]

    spec = {"model": {"name": "m"}, "catalog": {"file": {"path": str(catalog_file)}}, "clusters": 4,
            "podSelector": {"matchLabels": {"app": "engine"}}, "capacityPerPod": "8Gi",
            "etcd": etcd_spec(etcd_server)}
    state = ShardState()

    async def attempt() -> Outcome:
        return await reconcile(namespace=NS, name="secured", spec=spec, status={}, generation=1,
                               pods=[PodView("engine-0", {"app": "engine"}, True)], settings=SETTINGS, state=state,
                               trigger="created", logger=LOG, read_secret=read_secret)

    missing = await attempt()
    assert (missing.reason, condition(missing, "Ready")["status"]) == ("EtcdSecretInvalid", "False")
    assert f"Secret {NS}/{ETCD_TLS_SECRET}: Not Found" in condition(missing, "Ready")["message"]

    right = etcd_server.tls_secret_data()
    secrets[ETCD_TLS_SECRET] = {CERT_KEY: right[CERT_KEY], KEY_KEY: right[KEY_KEY]}
    no_ca = await attempt()
    assert no_ca.reason == "EtcdSecretInvalid" and "has no key ca.crt" in condition(no_ca, "Ready")["message"]

    stranger = make_etcd_certificates(tmp_path / "stranger")
    secrets[ETCD_TLS_SECRET] = {**right, CA_KEY: stranger.ca.read_bytes()}
    wrong_ca = await attempt()
    degraded = condition(wrong_ca, "Degraded")
    assert (wrong_ca.reason, degraded["status"], degraded["reason"]) == ("EtcdTLSFailed", "True", "EtcdTLSFailed")
    assert f"not signed by the CA from Secret {NS}/{ETCD_TLS_SECRET}" in degraded["message"]
    assert wrong_ca.retry_after is not None and wrong_ca.published is None

    secrets[ETCD_TLS_SECRET] = right
    published = await attempt()
    assert (published.reason, published.published) == ("Published", 1)
    assert condition(published, "Degraded")["status"] == "False"
    async with etcd_server.store() as store:
        assert await store.current_generation(NS, "secured") == 1

    # the warm timer reads through the same Secret
    found = await warmth.observe(namespace=NS, name="secured", spec=spec, settings=SETTINGS, read_secret=read_secret)
    assert found.reason == warmth.WARMING
    secrets[ETCD_TLS_SECRET] = {**right, CA_KEY: stranger.ca.read_bytes()}
    found = await warmth.observe(namespace=NS, name="secured", spec=spec, settings=SETTINGS, read_secret=read_secret)
    assert found.status == cond.UNKNOWN and "not signed by the CA" in found.message
