"""Placement values round-trip through their etcd encoding and never exceed 1 MiB."""

from __future__ import annotations

import pytest

from kvshard import placement_schema as ps


def sample(items: int = 10, clusters: int = 3) -> ps.Placement:
    return ps.Placement(
        generation=4,
        assignment={c: (f"pod-{c % 2}", "pod-9") for c in range(clusters)},
        item_clusters={f"item-{i}": i % clusters for i in range(items)},
        pods=("pod-0", "pod-1", "pod-9", "pod-idle"),
        model="m",
        revision="r",
        history_bytes_per_pod=1024,
    )


def test_placement_round_trips() -> None:
    original = sample()
    assignment, chunks = ps.encode(original)
    assert ps.decode(assignment, chunks) == original


def test_large_catalogs_are_chunked_below_one_mebibyte() -> None:
    original = sample(items=150_000, clusters=500)
    assignment, chunks = ps.encode(original)
    assert len(chunks) > 1
    assert all(len(c) <= ps.MAX_VALUE_BYTES for c in [assignment, *chunks])
    assert ps.decode(assignment, chunks).item_clusters == original.item_clusters


def test_missing_chunk_is_refused() -> None:
    assignment, chunks = ps.encode(sample(items=150_000))
    with pytest.raises(ps.PlacementFormatError, match="chunks"):
        ps.decode(assignment, chunks[:-1])


def test_unknown_schema_is_refused() -> None:
    with pytest.raises(ps.PlacementFormatError, match="schema"):
        ps.decode_assignment(b'{"schema": 99}')


def test_lookups_answer_for_pods_and_items() -> None:
    p = sample()
    assert p.clusters_of("pod-9") == [0, 1, 2]
    assert p.pods_for_item("item-1") == ("pod-1", "pod-9")
    assert p.pods_for_item("unknown") == ()
    assert p.items_of(2) == ["item-2", "item-5", "item-8"]


def test_warm_report_round_trips_and_garbage_is_refused() -> None:
    report = ps.WarmReport(3, (5, 1, 5), "http://10.0.0.7:8100", warming=2)
    assert ps.WarmReport.decode(report.encode()) == ps.WarmReport(3, (1, 5), "http://10.0.0.7:8100", 2)
    for garbage in (b"", b"[]", b'{"generation": "x", "clusters": []}', b"\xff"):
        with pytest.raises(ps.PlacementFormatError):
            ps.WarmReport.decode(garbage)
