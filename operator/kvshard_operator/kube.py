"""The few direct Kubernetes reads the operator needs beyond kopf's watches: a catalog ConfigMap,
the etcd Secrets (credentials, TLS) and a catalog URL's token Secret. Uses the official client (in-cluster
config, else KUBECONFIG); calls are blocking, so handlers run them in a thread.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Mapping
from typing import Any

from kvshard_operator.catalog import CatalogError


class SecretError(ValueError):
    """A Secret is missing (or unreadable), or lacks the keys it must have."""


@functools.cache
def _core_api() -> Any:
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
    return kubernetes.client.CoreV1Api()


def read_configmap(namespace: str, name: str) -> Mapping[str, str]:
    """``data`` of a ConfigMap, or :class:`CatalogError` (reason ``CatalogNotFound``)."""
    import kubernetes

    try:
        cm = _core_api().read_namespaced_config_map(name, namespace)
    except kubernetes.client.ApiException as exc:
        raise CatalogError("CatalogNotFound", f"ConfigMap {namespace}/{name}: {exc.reason}") from exc
    return dict(cm.data or {})


def read_secret(namespace: str, name: str) -> dict[str, bytes]:
    """A Secret's data decoded (key → bytes): the etcd credentials (``username``, ``password``) or
    TLS material (``ca.crt``, ``tls.crt``, ``tls.key``); :class:`SecretError` if it cannot be read.
    The caller checks the keys it needs."""
    import kubernetes

    try:
        secret = _core_api().read_namespaced_secret(name, namespace)
    except kubernetes.client.ApiException as exc:
        raise SecretError(f"Secret {namespace}/{name}: {exc.reason}") from exc
    return {key: base64.b64decode(value) for key, value in (secret.data or {}).items()}


def read_secret_key(namespace: str, name: str, key: str) -> str:
    """One key of a Secret (a catalog URL's bearer token), or :class:`SecretError`."""
    import kubernetes

    try:
        secret = _core_api().read_namespaced_secret(name, namespace)
    except kubernetes.client.ApiException as exc:
        raise SecretError(f"Secret {namespace}/{name}: {exc.reason}") from exc
    data = secret.data or {}
    if key not in data:
        raise SecretError(f"Secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(data[key]).decode()
