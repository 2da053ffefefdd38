"""kvshard router core: the pure parts the router service and the routing simulator share.

* :mod:`kvshard_router.snapshot` — an immutable, array-backed view of one placement generation plus
  warm sets and pod health, cheap to query per request even at 10 M items.
* :mod:`kvshard_router.policies` — one small :class:`~kvshard_router.policies.RoutingPolicy`
  interface and its implementations (round-robin, least-loaded, prefix-aware, affinity), found by
  name in a registry.

The hot/cold rebalancing *policy* lives in the shared core (:mod:`kvshard.rebalance`) because the
operator runs it and the simulator replays it; the router only follows its results.

Nothing here does I/O, so every decision can be tested and benchmarked directly.
"""

from kvshard_router.policies import (
    POLICIES,
    AffinityPolicy,
    LeastLoadedPolicy,
    LoadTable,
    LoadView,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    RouteRequest,
    RoutingPolicy,
    UnknownPolicyError,
    make_policy,
    register,
)
from kvshard_router.snapshot import ItemIndex, PodStatus, Snapshot, build_snapshot, warm_from_reports

__all__ = [
    "POLICIES",
    "AffinityPolicy",
    "ItemIndex",
    "LeastLoadedPolicy",
    "LoadTable",
    "LoadView",
    "PodStatus",
    "PrefixAwarePolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingPolicy",
    "Snapshot",
    "UnknownPolicyError",
    "build_snapshot",
    "make_policy",
    "register",
    "warm_from_reports",
]
