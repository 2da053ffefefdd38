"""Where the CacheShard CRD lives and how to read its schema.

``crds/`` at the repository top is the one source of the CRD (the Helm chart copies it). Two readers
need the same file: the operator, which validates every CacheShard itself (a clear status condition
beats a half-placed shard, whatever API server it runs behind), and the local cluster's Kubernetes
API (:mod:`kvshard_local.apiserver`), which serves the CRD's names, printer columns and OpenAPI
schema and refuses invalid CacheShards at admission. Hence it lives in the shared core. In an image,
point ``KVSHARD_CRD_PATH`` at the copied file.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import yaml

from kvshard.settings import environment

GROUP = "kvshard.io"
VERSION = "v1alpha1"
PLURAL = "cacheshards"
KIND = "CacheShard"
CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"


class CRDNotFoundError(FileNotFoundError):
    """The CRD file is neither at ``$KVSHARD_CRD_PATH`` nor in the source tree's ``crds/``."""


def crd_path() -> Path:
    """The CRD file: ``$KVSHARD_CRD_PATH`` if set, else ``crds/`` of the source checkout."""
    explicit = environment().kvshard_crd_path
    candidates = [explicit] if explicit is not None else []
    candidates.append(Path(__file__).resolve().parents[1] / "crds" / CRD_FILE)
    for path in candidates:
        if path.is_file():
            return path
    raise CRDNotFoundError(f"CRD {CRD_FILE} not found in {[str(p) for p in candidates]}; set KVSHARD_CRD_PATH")


@functools.cache
def load_crd(path: Path | None = None) -> dict[str, Any]:
    """The parsed CustomResourceDefinition (cached; the file does not change while we run)."""
    with open(path or crd_path(), encoding="utf-8") as f:
        return cast(dict[str, Any], yaml.safe_load(f))


def version_schema(crd: dict[str, Any], version: str = VERSION) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one served version."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return cast(dict[str, Any], entry["schema"]["openAPIV3Schema"])
    raise KeyError(f"version {version} not in CRD {crd['metadata']['name']}")
