"""kvshard operator: the control plane that places a CacheShard's item clusters onto pods.

It watches ``CacheShard`` objects (``crds/cacheshards.kvshard.io.yaml``), embeds and clusters the
catalog, assigns clusters to the selected pods with minimal movement, publishes the placement to
etcd (``kvshard.etcd_store``) and reports what it did in status conditions. Handlers are thin;
the logic lives in pure modules (``placement``, ``validation``, ``conditions``) that tests call
directly.
"""

__all__: list[str] = []
