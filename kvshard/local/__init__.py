"""The local cluster: every kvshard process on loopback, for development, demos and end-to-end tests.

``kvshard up --pods N`` / ``kvshard down`` on the command line, :class:`LocalCluster` in Python.
This package starts the components as subprocesses through the ``kvshard`` CLI and never imports
them, so it stays in the torch-free core.
"""

from kvshard.local.cluster import ClusterStartError, LocalCluster
from kvshard.local.run_folder import ClusterAlreadyRunningError
from kvshard.local.settings import LocalClusterSettings

__all__ = ["ClusterAlreadyRunningError", "ClusterStartError", "LocalCluster", "LocalClusterSettings"]
