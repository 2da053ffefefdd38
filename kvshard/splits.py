"""Who a recommender may learn from, and what it is judged on: the leave-one-out split.

Why it exists. A fine-tuned recommender is only worth measuring if it never saw the answers it is
measured on. The benchmarks' target is each user's *last* interaction (``sample_requests`` holds it
out), so training must never touch it — not as a target, not inside a history, not as a sampled
negative. The split here is the one definition the trainer and the benchmarks share:

* users are split by a salted hash of their id (stable across runs, processes and datasets that
  grow): *held-out* users are the benchmark's and are never trained on at all;
* a training user's last interaction is never used; the second-to-last is the validation target;
  training targets come strictly before it, with only earlier items as their history.

Candidate sets mirror ``kvshard.prompts.sample_requests``: the target plus negatives the user never
interacted with (anywhere in their history, so the last item is never even a negative), shuffled, so
the position of the right answer carries no signal. Everything is seeded; torch-free.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from kvshard.datasets import Dataset
from kvshard.prompts import RecommendationRequest

DEFAULT_SALT = "kvshard-recommender-split-v1"
DEFAULT_HELDOUT_FRACTION = 0.2


@dataclass(frozen=True)
class UserSplit:
    """Users whose salted hash falls below ``heldout_fraction`` are held out (benchmark only)."""

    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
    salt: str = DEFAULT_SALT

    def __post_init__(self) -> None:
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")

    def is_heldout(self, user: str) -> bool:
        digest = hashlib.blake2b(f"{self.salt}\x00{user}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < self.heldout_fraction

    def training_users(self, dataset: Dataset) -> list[str]:
        return [u for u in dataset.histories if not self.is_heldout(u)]

    def heldout_users(self, dataset: Dataset) -> list[str]:
        return [u for u in dataset.histories if self.is_heldout(u)]

    def heldout_dataset(self, dataset: Dataset) -> Dataset:
        """The dataset restricted to held-out users (same catalog): what the benchmarks sample from."""
        return Dataset(name=dataset.name, items=dataset.items,
                       histories={u: h for u, h in dataset.histories.items() if self.is_heldout(u)})

    def describe(self, dataset: Dataset) -> dict[str, object]:
        """The split as provenance records it."""
        return {"rule": "blake2b-64(salt NUL user) / 2**64 < heldout_fraction → held out",
                "salt": self.salt, "heldout_fraction": self.heldout_fraction,
                "training_users": len(self.training_users(dataset)),
                "heldout_users": len(self.heldout_users(dataset)),
                "training_targets": "positions before each training user's second-to-last interaction",
                "validation_targets": "each training user's second-to-last interaction",
                "never_used": "every user's last interaction; every held-out user's data"}


def _negatives(rng: random.Random, all_items: Sequence[str], seen: set[str], count: int) -> list[str]:
    unseen = len(all_items) - len(seen & set(all_items))
    if unseen < count:
        raise ValueError(f"only {unseen} unseen items for {count} negatives")
    chosen: list[str] = []
    while len(chosen) < count:
        choice = rng.choice(all_items)
        if choice not in seen and choice not in chosen:
            chosen.append(choice)
    return chosen


HardNegatives = Callable[[Sequence[str], Collection[str], int], list[str]]
"""``(history shown, items to exclude, count) -> negatives``: a retrieval stage's items for a history
(:meth:`kvshard.retrieval.RetrievalIndex.hard_negatives`), none of them excluded."""


def _request(rng: random.Random, dataset: Dataset, all_items: Sequence[str], user: str, position: int,
             history: int, candidates: int, hard: HardNegatives | None = None,
             hard_count: int = 0, positives: int = 1) -> RecommendationRequest:
    items = dataset.histories[user]
    target = items[position]
    # Later targets stop before the validation target (len - 2), whatever the position.
    later = tuple(i for i in dict.fromkeys(items[position + 1:min(len(items) - 2, position + positives)])
                  if i != target)
    shown = tuple(items[position - history:position])
    seen = set(items)
    hard_count = min(hard_count, candidates - 1 - len(later))
    negatives = hard(shown, seen, hard_count) if hard is not None and hard_count > 0 else []
    negatives += _negatives(rng, all_items, seen | set(negatives), candidates - 1 - len(later) - len(negatives))
    pool = [target, *later, *negatives]
    rng.shuffle(pool)
    return RecommendationRequest(user, shown, tuple(pool), target, later)


def _check(history: int, candidates: int) -> None:
    if candidates < 2:
        raise ValueError("candidates must be at least 2 (the target and one negative)")
    if history < 1:
        raise ValueError("history must be at least 1")


def training_positions(dataset: Dataset, users: Iterable[str], history: int, window: int) -> list[tuple[str, int]]:
    """Every (user, target position) training may use: at least ``history`` items before it, strictly
    before the user's second-to-last interaction, and among the ``window`` positions closest to it
    (recent interactions look most like the held-out ones); ``window`` 0 means no limit."""
    positions = []
    for user in users:
        n = len(dataset.histories[user])
        stop = n - 2  # position of the validation target; the last (n - 1) is never used
        start = max(history, stop - window if window > 0 else 0)
        positions += [(user, i) for i in range(start, stop)]
    return positions


def training_requests(dataset: Dataset, users: Sequence[str], history: int, candidates: int, count: int,
                      seed: int = 0, window: int = 0, hard: HardNegatives | None = None,
                      hard_share: float = 0.0, positives: int = 1) -> list[RecommendationRequest]:
    """``count`` seeded training requests drawn without replacement from :func:`training_positions`
    (fewer if there are fewer positions), in a seeded random order.

    Negatives are unseen items drawn uniformly, except that with ``hard`` the first
    ``round(hard_share · (candidates − 1))`` come from it — the items a retrieval stage would hand the
    reranker for the shown history, never one the user interacted with. The target is kept whether or
    not the stage would have retrieved it, which is not the stage's selection (measured in
    ``bench/experiments/hard_negative_selection.py``).

    With ``positives`` above 1, the user's next ``positives - 1`` distinct items after the target — never
    the validation target or later — are among the candidates too, as the request's ``later_targets``
    (fewer near the validation target). Without ``hard`` and with one positive the requests are those of
    earlier releases, byte for byte (the same seed draws the same negatives)."""
    _check(history, candidates)
    if not 0.0 <= hard_share <= 1.0:
        raise ValueError(f"hard_share must be in [0, 1], got {hard_share}")
    if not 1 <= positives < candidates:
        raise ValueError(f"positives must be in [1, candidates), got {positives}")
    rng = random.Random(seed)
    positions = training_positions(dataset, users, history, window)
    rng.shuffle(positions)
    all_items = sorted(dataset.items)
    hard_count = round(hard_share * (candidates - 1)) if hard is not None else 0
    return [_request(rng, dataset, all_items, user, i, history, candidates, hard, hard_count, positives)
            for user, i in positions[:count]]


def validation_requests(dataset: Dataset, users: Sequence[str], history: int, candidates: int, count: int,
                        seed: int = 0) -> list[RecommendationRequest]:
    """One request per user (up to ``count`` users, a seeded sample): the second-to-last interaction
    as the target, the ``history`` items before it as the history."""
    _check(history, candidates)
    rng = random.Random(seed)
    eligible = [u for u in users if len(dataset.histories[u]) - 2 >= history]
    rng.shuffle(eligible)
    all_items = sorted(dataset.items)
    return [_request(rng, dataset, all_items, u, len(dataset.histories[u]) - 2, history, candidates)
            for u in eligible[:count]]
