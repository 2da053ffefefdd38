"""Paired comparisons over the same requests, with intervals that resample users.

Why it exists. Two rankings of the same requests differ by much less than either's own interval (at 191
held-out users an HR@1 interval is ±.07), so ``kvshard bench recommender`` judges a difference request by
request. And with several requests per user (``--positions``) the requests are not independent: a user who
is easy to rank is easy at every position, so every interval here resamples users, a user's requests
together. Pure functions over per-request numbers; the bench and the experiments share them.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence

BOOTSTRAP_SAMPLES = 1000
PAIRED_METRICS = ("hr1", "ndcg10")


def bootstrap_ci(values: Sequence[float], seed: int, samples: int = BOOTSTRAP_SAMPLES,
                 clusters: Sequence[str] | None = None) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean of ``values`` (one per request), resampling users:
    ``clusters`` names each value's user, and a resampled user brings all of its values (``None``: each
    value its own user, one request per user)."""
    if not values:
        return (0.0, 0.0)
    rng = random.Random(seed)
    if clusters is None:
        means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(samples))
    else:
        if len(clusters) != len(values):
            raise ValueError(f"{len(clusters)} users for {len(values)} values")
        groups: dict[str, list[float]] = {}
        for cluster, value in zip(clusters, values, strict=True):
            groups.setdefault(cluster, []).append(value)
        sums = [(math.fsum(group), len(group)) for group in groups.values()]
        means = []
        for _ in range(samples):
            drawn = rng.choices(sums, k=len(sums))
            means.append(math.fsum(total for total, _ in drawn) / sum(count for _, count in drawn))
        means.sort()
    return means[int(0.025 * samples)], means[int(0.975 * samples) - 1]


def paired_difference(candidate: Sequence[float], reference: Sequence[float], seed: int,
                      clusters: Sequence[str] | None = None) -> tuple[float, float, float]:
    """Mean of ``candidate - reference`` over the same requests and its 95 % bootstrap interval (resampling
    users, :func:`bootstrap_ci`): two rankings of the same requests differ by much less than either's own
    interval, so a comparison is judged by this, not by whether their intervals overlap."""
    differences = [a - b for a, b in zip(candidate, reference, strict=True)]
    low, high = bootstrap_ci(differences, seed, clusters=clusters)
    return (statistics.fmean(differences) if differences else 0.0), low, high


def paired_fields(ranking: Sequence[Mapping[str, float]], references: Mapping[str, Sequence[Mapping[str, float]]],
                  seed: int, clusters: Sequence[str] | None = None) -> dict[str, dict[str, list[float]]]:
    """A row's ``paired`` field: per reference ranking (the first model listed, the baselines) and metric,
    ``[mean difference, 95 % low, high]`` of ``ranking - reference`` on the same requests
    (:func:`paired_difference`)."""
    return {name: {m: list(paired_difference([q[m] for q in ranking], [q[m] for q in values], seed, clusters))
                   for m in PAIRED_METRICS}
            for name, values in references.items()}
