"""The local cluster's Kubernetes API: kmock's server answering kubectl like a real API server.

``python -m kvshard_local.emulator`` runs it for ``kvshard up``; tests serve
:class:`LocalKubeApi` with ``kmock.Server``. It exists for the local cluster and the tests, not as a
product API server: it serves the kinds the local cluster uses (CacheShards from the CRD, Pods,
ConfigMaps, Secrets, Events, Namespaces), keeps everything in memory, and leaves out what kvshard
never needs (server-side apply, garbage collection of owned objects, authorization, protobuf).
"""

from kvshard_local.apiserver.resources import ResourceType
from kvshard_local.apiserver.server import LocalKubeApi, default_types
from kvshard_local.apiserver.store import Store

__all__ = ["LocalKubeApi", "ResourceType", "Store", "default_types"]
