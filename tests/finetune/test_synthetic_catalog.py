"""`kvshard bench synthetic-catalog`: a catalog in the generic format, the same for the same seed, with the
co-occurrence and popularity skew it claims planted in its interactions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kvshard.cli import main
from kvshard.datasets import load_dataset
from kvshard_bench.synthetic_catalog import (
    CatalogShape,
    CatalogShapeError,
    SyntheticCatalog,
    generate,
    same_group_share,
    top_share,
    write,
)

SMALL = CatalogShape(items=200, users=120, groups=8, min_history=12, max_history=30)


def _same_group_share(catalog: SyntheticCatalog) -> float:
    """Share of a user's consecutive interactions whose items share a group (counted here from the rows,
    independently of the module's own measure)."""
    by_user: dict[str, list[str]] = {}
    for row in catalog.interactions:
        by_user.setdefault(str(row["user"]), []).append(str(row["item"]))
    pairs = [(a, b) for items in by_user.values() for a, b in zip(items, items[1:], strict=False)]
    return sum(catalog.groups[a] == catalog.groups[b] for a, b in pairs) / len(pairs)


def _top_decile_share(catalog: SyntheticCatalog) -> float:
    counts = Counter(str(row["item"]) for row in catalog.interactions)
    top = sorted(counts.values(), reverse=True)[: len(catalog.items) // 10]
    return sum(top) / len(catalog.interactions)


def test_the_printed_measures_agree_with_the_rows() -> None:
    catalog = generate(SMALL)
    assert same_group_share(catalog) == pytest.approx(_same_group_share(catalog))
    assert top_share(catalog) == pytest.approx(_top_decile_share(catalog))


def test_the_same_seed_writes_the_same_bytes_and_another_seed_does_not(tmp_path: Path) -> None:
    first, again = write(generate(SMALL), SMALL, tmp_path / "a"), write(generate(SMALL), SMALL, tmp_path / "b")
    other_shape = CatalogShape(**{**SMALL.__dict__, "seed": 1})
    other = write(generate(other_shape), other_shape, tmp_path / "c")
    for name in ("items.jsonl", "interactions.jsonl", "synthetic.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    assert (first / "interactions.jsonl").read_bytes() != (other / "interactions.jsonl").read_bytes()


def test_load_dataset_reads_it_with_every_user_and_history_length_as_asked(tmp_path: Path) -> None:
    dataset = load_dataset(str(write(generate(SMALL), SMALL, tmp_path / "catalog")))
    assert len(dataset.items) == SMALL.items and len(dataset.histories) == SMALL.users
    for history in dataset.histories.values():
        assert SMALL.min_history <= len(history) <= SMALL.max_history
        assert len(set(history)) == len(history)  # no item twice in one history
    assert len({item.text for item in dataset.items.values()}) == SMALL.items


def test_users_mostly_stay_in_a_group_as_planted() -> None:
    catalog = generate(SMALL)
    assert _same_group_share(catalog) == pytest.approx(SMALL.stay, abs=0.05)
    # without the planted stay, consecutive items share a group about 1 / groups of the time
    assert _same_group_share(generate(CatalogShape(**{**SMALL.__dict__, "stay": 0.0}))) < 0.05


def test_popularity_is_skewed_by_zipf_and_flat_without_it() -> None:
    skewed = _top_decile_share(generate(SMALL))
    flat = _top_decile_share(generate(CatalogShape(**{**SMALL.__dict__, "zipf": 0.0})))
    assert skewed > 1.5 * flat and flat < 0.2  # the 10 % most popular items: a quarter of it all vs 14 %


def test_texts_name_the_group_last_unless_hidden() -> None:
    shown, hidden = generate(SMALL), generate(CatalogShape(**{**SMALL.__dict__, "hide_groups": True}))
    group_names = {item["id"]: item["text"].rsplit(", ", 1)[1] for item in shown.items}
    for a in shown.items:  # one name per group, and a different name for each group
        for b in shown.items[:20]:
            assert (group_names[a["id"]] == group_names[b["id"]]) == (shown.groups[a["id"]] == shown.groups[b["id"]])
    assert not any("," in item["text"] or set(item["text"].split()) & set(group_names.values())
                   for item in hidden.items)


@pytest.mark.parametrize("bad", [{"groups": 1}, {"items": 10, "groups": 8}, {"stay": 1.5}, {"zipf": -1.0},
                                 {"min_history": 40, "max_history": 30}, {"max_history": 500}])
def test_impossible_shapes_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(CatalogShapeError):
        generate(CatalogShape(**{**SMALL.__dict__, **bad}))


def test_the_bench_command_writes_a_catalog(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["bench", "synthetic-catalog", "--out", str(out), "--items", "40", "--users", "6", "--groups", "4",
                 "--min-history", "5", "--max-history", "8", "--seed", "3"]) == 0
    assert "40 items in 4 groups, 6 users" in capsys.readouterr().out
    assert len(load_dataset(str(out)).histories) == 6
