"""The CacheShard CRD file and its schema, re-exported from the shared core (:mod:`kvshard.crd`),
which the local cluster's Kubernetes API reads too."""

from kvshard.crd import (
    CRD_FILE,
    CRD_NAME,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    CRDNotFoundError,
    crd_path,
    load_crd,
    version_schema,
)

__all__ = ["CRD_FILE", "CRD_NAME", "GROUP", "KIND", "PLURAL", "VERSION", "CRDNotFoundError", "crd_path", "load_crd",
           "version_schema"]
