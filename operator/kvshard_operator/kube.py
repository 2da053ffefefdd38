"""The few direct Kubernetes reads the operator needs beyond kopf's watches: a catalog ConfigMap
and the etcd credentials Secret. Uses the official client (in-cluster config, else KUBECONFIG);
calls are blocking, so handlers run them in a thread.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Mapping
from typing import Any

from kvshard_operator.catalog import CatalogError


class SecretError(ValueError):
    """The etcd Secret is missing or lacks ``username``/``password``."""


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


def read_etcd_credentials(namespace: str, name: str) -> tuple[str, str]:
    """``(username, password)`` from a Secret, or :class:`SecretError`."""
    import kubernetes

    try:
        secret = _core_api().read_namespaced_secret(name, namespace)
    except kubernetes.client.ApiException as exc:
        raise SecretError(f"Secret {namespace}/{name}: {exc.reason}") from exc
    data = secret.data or {}
    if "username" not in data or "password" not in data:
        raise SecretError(f"Secret {namespace}/{name} needs keys username and password")
    return base64.b64decode(data["username"]).decode(), base64.b64decode(data["password"]).decode()
