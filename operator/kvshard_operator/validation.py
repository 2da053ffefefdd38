"""CacheShard validation against the CRD's own schema and CEL rules, re-exported from the shared
core (:mod:`kvshard.crd_validation`), where the local cluster's API uses the same checks at
admission. The operator validates again because it must not trust the API server it runs behind."""

from kvshard.crd_validation import (
    InvalidCacheShardError,
    Violation,
    apply_defaults,
    validate,
    validate_spec,
    violations,
)

__all__ = ["InvalidCacheShardError", "Violation", "apply_defaults", "validate", "validate_spec", "violations"]
