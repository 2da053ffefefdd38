"""``kvshard bench synthetic-catalog``: a second catalog, in the generic format, with structure planted in it.

Why it exists. Every number kvshard reports about recommendation quality was measured on MovieLens-100k,
whose titles SmolLM2 may have read in pre-training. A catalog whose items are made-up words asks the other
question: does ``kvshard model finetune`` — the same command, unchanged — learn a recommender from *your*
catalog's interactions? The structure is planted, so what there is to learn is known:

* **Groups (co-occurrence).** ``--groups`` latent groups of equal size. Each user starts in a random group
  and, interaction after interaction, stays in the current group with probability ``--stay`` or moves to
  another group drawn uniformly. So the next item's group is usually the last items' group: item-kNN over
  training users finds it, and so can a model that reads the history.
* **Popularity (Zipf).** Every item has a popularity rank (a seeded permutation) and weight
  ``1 / rank ** --zipf``; within its group a user picks an unseen item in proportion to that weight. So
  a popularity ranking is a real baseline, as it is on MovieLens (there .246 HR@1 at 20 candidates).
* **Texts.** An item's text is a made-up name and, after a comma, its group's made-up name
  (``"Dovira Semak, Pulento"``): words no pre-trained model has seen, so nothing is known before
  training. The group name is shown — as MovieLens texts show genres — because a recommender that reads
  prompts is meant to use what item texts say; with ``--hide-groups`` the text is the item's name alone,
  and only memorising which names co-occur can work (a harder task for an hour of CPU). The group name
  stands last so that a late scorer's interaction tokens (an item's last tokens, which read the history)
  hold it.

Histories have between ``--min-history`` and ``--max-history`` interactions (at least 20, so every user
has a benchmark request at the default 10-item history), one per timestamp, without repeats. The output
is deterministic in its arguments: the same ``--seed`` writes the same bytes. Beside ``items.jsonl`` and
``interactions.jsonl`` the folder gets ``synthetic.json``: the arguments and each item's group (which
:func:`kvshard.datasets.load_dataset` ignores; it is for checking what was learned).
"""

from __future__ import annotations

import argparse
import json
import random
from bisect import bisect_left
from collections import Counter
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
START_TIME = 1_700_000_000  # the first interaction's timestamp; one second per interaction after it


class CatalogShapeError(ValueError):
    """Arguments that cannot make a catalog (the message says which and why)."""


@dataclass(frozen=True)
class CatalogShape:
    """What to generate; every field is a flag of ``kvshard bench synthetic-catalog``."""

    items: int = 1000
    users: int = 800
    groups: int = 20
    zipf: float = 1.0
    stay: float = 0.85
    min_history: int = 20
    max_history: int = 60
    hide_groups: bool = False
    seed: int = 0

    def validate(self) -> None:
        if self.groups < 2 or self.items < 2 * self.groups:
            raise CatalogShapeError("--groups must be at least 2 and --items at least 2 per group")
        if self.users < 1 or not 2 <= self.min_history <= self.max_history:
            raise CatalogShapeError("--users must be at least 1 and 2 <= --min-history <= --max-history")
        if self.max_history > self.items:
            raise CatalogShapeError("--max-history cannot exceed --items (histories never repeat an item)")
        if not 0.0 <= self.stay <= 1.0 or self.zipf < 0:
            raise CatalogShapeError("--stay must be in [0, 1] and --zipf at least 0")


@dataclass(frozen=True)
class SyntheticCatalog:
    """The generated catalog: item rows, interaction rows (the generic format's JSON Lines) and each item's group."""

    items: list[dict[str, str]]
    interactions: list[dict[str, str | int]]
    groups: dict[str, int]


def made_up_words(count: int, rng: random.Random, taken: set[str]) -> list[str]:
    """``count`` distinct capitalised pronounceable non-words (two or three consonant-vowel syllables and a
    closing consonant), none already in ``taken`` (which gains them)."""
    words: list[str] = []
    while len(words) < count:
        syllables = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.choice((2, 3))))
        word = (syllables + rng.choice(CONSONANTS + "  ").strip()).capitalize()
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def generate(shape: CatalogShape) -> SyntheticCatalog:
    """The catalog ``shape`` describes (pure: the same shape gives the same catalog)."""
    shape.validate()
    rng = random.Random(shape.seed)
    taken: set[str] = set()
    group_names = made_up_words(shape.groups, rng, taken)
    first, second = made_up_words(shape.items, rng, taken), made_up_words(shape.items, rng, taken)
    ids = [str(i + 1) for i in range(shape.items)]
    group_of = {item: index % shape.groups for index, item in enumerate(ids)}
    ranks = list(range(1, shape.items + 1))
    rng.shuffle(ranks)
    weight = {item: rank ** -shape.zipf for item, rank in zip(ids, ranks, strict=True)}
    members: list[list[str]] = [[] for _ in range(shape.groups)]
    for item in ids:
        members[group_of[item]].append(item)
    items = []
    for index, item in enumerate(ids):
        name = f"{first[index]} {second[index]}"
        text = name if shape.hide_groups else f"{name}, {group_names[group_of[item]]}"
        items.append({"id": item, "text": text})
    interactions: list[dict[str, str | int]] = []
    clock = START_TIME
    for user in range(1, shape.users + 1):
        group = rng.randrange(shape.groups)
        seen: set[str] = set()
        for _ in range(rng.randint(shape.min_history, shape.max_history)):
            if rng.random() >= shape.stay:
                group = rng.choice([g for g in range(shape.groups) if g != group])
            pool = [item for item in members[group] if item not in seen]
            if not pool:  # the group is exhausted for this user: go elsewhere
                group = rng.choice([g for g in range(shape.groups) if any(i not in seen for i in members[g])])
                pool = [item for item in members[group] if item not in seen]
            chosen = _weighted_choice(pool, [weight[item] for item in pool], rng)
            seen.add(chosen)
            interactions.append({"user": str(user), "item": chosen, "timestamp": clock})
            clock += 1
    return SyntheticCatalog(items, interactions, group_of)


def top_share(catalog: SyntheticCatalog, fraction: float = 0.1) -> float:
    """Share of all interactions that go to the ``fraction`` most interacted-with items (the skew, measured)."""
    counts = sorted(Counter(str(row["item"]) for row in catalog.interactions).values(), reverse=True)
    return sum(counts[: max(1, int(len(catalog.items) * fraction))]) / max(1, len(catalog.interactions))


def same_group_share(catalog: SyntheticCatalog) -> float:
    """Share of users' consecutive interactions whose two items share a group (the co-occurrence, measured)."""
    previous: dict[str, str] = {}
    same = pairs = 0
    for row in catalog.interactions:
        user, item = str(row["user"]), str(row["item"])
        if user in previous:
            pairs += 1
            same += catalog.groups[previous[user]] == catalog.groups[item]
        previous[user] = item
    return same / max(1, pairs)


def _weighted_choice(pool: list[str], weights: list[float], rng: random.Random) -> str:
    """One of ``pool`` with probability proportional to ``weights`` (one ``rng.random()`` draw)."""
    cumulative = list(accumulate(weights))
    return pool[min(bisect_left(cumulative, rng.random() * cumulative[-1]), len(pool) - 1)]


def write(catalog: SyntheticCatalog, shape: CatalogShape, folder: Path) -> Path:
    """``items.jsonl``, ``interactions.jsonl`` and ``synthetic.json`` in ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("items.jsonl", catalog.items), ("interactions.jsonl", catalog.interactions)):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    record = {"generator": "kvshard bench synthetic-catalog", "shape": asdict(shape), "groups": catalog.groups}
    (folder / "synthetic.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = CatalogShape()
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write the catalog into")
    parser.add_argument("--items", type=int, default=defaults.items, help="catalog size (default: %(default)s)")
    parser.add_argument("--users", type=int, default=defaults.users, help="users (default: %(default)s)")
    parser.add_argument("--groups", type=int, default=defaults.groups,
                        help="latent groups users move within (default: %(default)s)")
    parser.add_argument("--zipf", type=float, default=defaults.zipf,
                        help="popularity skew: item weight = 1 / rank ** zipf (default: %(default)s)")
    parser.add_argument("--stay", type=float, default=defaults.stay,
                        help="probability that the next interaction stays in the current group (default: %(default)s)")
    parser.add_argument("--min-history", type=int, default=defaults.min_history,
                        help="fewest interactions per user (default: %(default)s)")
    parser.add_argument("--max-history", type=int, default=defaults.max_history,
                        help="most interactions per user (default: %(default)s)")
    parser.add_argument("--hide-groups", action="store_true",
                        help="item texts without their group's name (only co-occurrence can be learned)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="generator seed (default: %(default)s)")


def run(args: argparse.Namespace) -> Path:
    """Generate and write the catalog; print where, and its size."""
    shape = CatalogShape(items=args.items, users=args.users, groups=args.groups, zipf=args.zipf, stay=args.stay,
                         min_history=args.min_history, max_history=args.max_history,
                         hide_groups=args.hide_groups, seed=args.seed)
    catalog = generate(shape)
    folder = write(catalog, shape, args.out)
    print(f"{folder}: {len(catalog.items)} items in {shape.groups} groups, {shape.users} users, "
          f"{len(catalog.interactions)} interactions (zipf {shape.zipf}, stay {shape.stay}, seed {shape.seed}); "
          f"the 10 % most popular items have {top_share(catalog):.0%} of the interactions, consecutive "
          f"interactions share a group {same_group_share(catalog):.0%} of the time")
    return folder
