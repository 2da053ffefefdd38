"""The few direct Kubernetes calls the operator needs beyond kopf's watches: a catalog ConfigMap,
the etcd Secrets (credentials, TLS), a catalog URL's token Secret, and its embedding Jobs. Uses the
official client (in-cluster config, else KUBECONFIG); calls are blocking, so handlers run them in a
thread.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Mapping
from typing import Any

from kvshard_operator import embed_job
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


@functools.cache
def _batch_api() -> Any:
    import kubernetes

    _core_api()  # loads the configuration
    return kubernetes.client.BatchV1Api()


class JobApiError(RuntimeError):
    """A Job call failed (RBAC, the API down): the reconcile retries it with backoff."""


class Jobs:
    """:class:`embed_job.JobApi` against the API server (create and get Jobs; never delete). Jobs are
    created owned by ``owner`` (the CacheShard: ``apiVersion``, ``kind``, ``name``, ``uid``) when given."""

    def __init__(self, owner: Mapping[str, str] | None = None) -> None:
        self.owner = owner

    def read_job(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        import kubernetes

        try:
            job = _batch_api().read_namespaced_job(name, namespace)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise JobApiError(f"Job {namespace}/{name}: {exc.status} {exc.reason}") from exc
        found: Mapping[str, Any] = kubernetes.client.ApiClient().sanitize_for_serialization(job)  # type: ignore[no-untyped-call]
        return found

    def create_job(self, namespace: str, body: Mapping[str, Any]) -> None:
        import kubernetes

        try:
            _batch_api().create_namespaced_job(namespace, embed_job.owned_by(body, self.owner) if self.owner
                                               else dict(body))
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:  # created meanwhile (an earlier attempt): the same plan, the same Job
                raise JobApiError(f"creating Job in {namespace}: {exc.status} {exc.reason}") from exc
