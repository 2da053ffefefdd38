"""What a sidecar follows in etcd without a restart: its placement, its catalog and its blend settings.

The followers turn what changed into work for the serving room — blocks to warm (its prefill queue),
blocks to drop, a catalog to switch to, a blend policy to apply — and never serve a request themselves.
"""
