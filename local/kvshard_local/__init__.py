"""The local cluster: every kvshard process on loopback, for development, demos and end-to-end tests.

``kvshard up --pods N`` / ``kvshard down`` on the command line, :class:`LocalCluster` in Python.
This package starts the components as subprocesses through the ``kvshard`` CLI and never imports
them. It is its own distribution (``pip install ./local``) that no image installs.
"""

from kvshard_local.cluster import ClusterStartError, LocalCluster
from kvshard_local.run_folder import ClusterAlreadyRunningError
from kvshard_local.settings import LocalClusterSettings

__all__ = ["ClusterAlreadyRunningError", "ClusterStartError", "LocalCluster", "LocalClusterSettings"]
