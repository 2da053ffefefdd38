"""A sidecar follows its CacheShard's blend settings in force (``blend`` in etcd) without a restart.

The operator publishes the method, the recompute ratio and the shadow-check sample rate beside the
placement (:class:`kvshard.blend_policy.BlendPolicy`); its fidelity controller changes the ratio one
ladder rung at a time. Each new value applies to the next request parsed: requests already parsed keep
theirs, and a request's own ``blend`` still overrides per call. Runs as one task of the placement
follower's etcd session (:mod:`kvshard_sidecar.follow.placement`), so reconnects and backoff are shared: while
etcd is away the last settings stay in force. The first read — a published blend or none — tells the
service it knows what is in force (:meth:`SidecarService.blend_read`): ``/readyz`` waits for it.
"""

from __future__ import annotations

from kvshard.etcd_store import EtcdStore
from kvshard_sidecar.serving.service import SidecarService


async def follow_blend(store: EtcdStore, namespace: str, name: str, service: SidecarService) -> None:
    """Apply every blend policy published for ``namespace/name`` (the current one first)."""
    async for policy in store.watch_blend(namespace, name):
        if policy is not None:
            service.use_blend(policy)
        service.blend_read()
