"""Catalog versions: parsing that names every bad line, diffs, and the chunked, content-addressed
encoding pods read from etcd (against a real etcd)."""

from __future__ import annotations

import itertools
import json

import pytest

from kvshard import catalog_schema as cs
from kvshard_local.testing_servers import EtcdServer

_names = itertools.count()


def jsonl(*rows: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def test_every_bad_line_is_named_up_to_five_with_the_count_of_the_rest() -> None:
    text = jsonl({"id": "a", "text": "fine"}, "not json", {"id": "b", "text": "  "}, {"id": "a", "text": "again"},
                 {"text": "no id"}, {"id": True, "text": "bool id"}, {"id": "c"}, {"id": "d", "text": "ok"})
    with pytest.raises(cs.CatalogError) as info:
        cs.parse_jsonl(text, "ConfigMap shop/items key items.jsonl")
    error = info.value
    assert error.reason == "CatalogInvalid"
    assert [line.split(":")[0] for line in error.bad_lines] == ["line 2", "line 3", "line 4", "line 5", "line 6"]
    assert "duplicate id 'a' (first on line 1)" in error.bad_lines[2]
    assert "6 bad line(s)" in str(error) and "(and 1 more)" in str(error)
    assert str(error).startswith("ConfigMap shop/items key items.jsonl")


def test_texts_become_one_line_and_extra_scalar_fields_are_kept() -> None:
    cat = cs.parse_jsonl(jsonl({"id": 7, "text": "Dune\n  (novel)", "author": "Herbert", "year": 1965,
                                "tags": ["sf"]}), "x")
    assert (cat.ids, cat.texts) == (("7",), ("Dune (novel)",))
    assert dict(cat.fields_of(0)) == {"author": "Herbert", "year": "1965"}


def test_the_version_changes_with_any_text_or_field_and_only_then() -> None:
    base = cs.parse_jsonl(jsonl({"id": "a", "text": "x", "brand": "b"}, {"id": "b", "text": "y"}), "x")
    same = cs.parse_jsonl(jsonl({"id": "a", "text": "x", "brand": "b"}, {"id": "b", "text": "y"}), "x")
    other_field = cs.parse_jsonl(jsonl({"id": "a", "text": "x", "brand": "c"}, {"id": "b", "text": "y"}), "x")
    other_text = cs.parse_jsonl(jsonl({"id": "a", "text": "x", "brand": "b"}, {"id": "b", "text": "z"}), "x")
    assert base.version == same.version
    assert len({base.version, other_field.version, other_text.version}) == 3


def test_diff_names_added_edited_and_removed_items() -> None:
    old = cs.parse_jsonl(jsonl(*({"id": str(i), "text": f"t{i}"} for i in range(5))), "old")
    new = cs.parse_jsonl(jsonl({"id": "0", "text": "t0"}, {"id": "1", "text": "changed"},
                               {"id": "3", "text": "t3"}, {"id": "4", "text": "t4"}, {"id": "9", "text": "new"},
                               {"id": "8", "text": "new"}), "new")
    change = cs.diff(old, new)
    assert (change.added, change.edited, change.removed) == (("9", "8"), ("1",), ("2",))
    assert change.summary() == "+2 ~1 \u22121"
    assert cs.diff(new, new).empty


def test_a_large_catalog_is_split_into_chunks_under_one_mib_and_read_back_exactly() -> None:
    rows = [{"id": f"item-{i}", "text": f"Synthetic item {i} " + "word " * 20, "shelf": str(i % 7)}
            for i in range(30_000)]
    cat = cs.parse_jsonl(jsonl(*rows), "big")
    manifest, chunks = cs.encode(cat)
    assert len(chunks) >= 3 and all(len(c) <= cs.MAX_VALUE_BYTES for c in chunks)
    assert json.loads(manifest)["items"] == 30_000
    assert cs.decode(manifest, chunks) == cat


def test_a_damaged_or_incomplete_version_is_refused() -> None:
    cat = cs.parse_jsonl(jsonl({"id": "a", "text": "x"}, {"id": "b", "text": "y"}), "x")
    manifest, chunks = cs.encode(cat)
    tampered = chunks[0].replace(b'"x"', b'"X"')
    with pytest.raises(cs.CatalogError, match="hash to"):
        cs.decode(manifest, [tampered])
    with pytest.raises(cs.CatalogError, match="0 of 1 chunks"):
        cs.decode(manifest, [])


async def test_versions_are_stored_once_read_back_and_pruned(etcd_server: EtcdServer) -> None:
    shard = ("ns", f"catalog-{next(_names)}")
    first = cs.parse_jsonl(jsonl(*({"id": str(i), "text": f"item {i} " * 30} for i in range(20_000))), "a")
    second = cs.parse_jsonl(jsonl({"id": "x", "text": "only"}), "b")
    async with etcd_server.store(timeout=5) as store:
        written = await store.put_catalog(*shard, first)
        assert written > cs.MAX_VALUE_BYTES  # several chunks
        assert await store.put_catalog(*shard, first) == 0  # content-addressed: not written twice
        assert await store.read_catalog(*shard, first.version) == first
        manifest = await store.read_catalog_manifest(*shard, first.version)
        assert manifest is not None and manifest["items"] == 20_000 and manifest["bytes"] < written
        await store.put_catalog(*shard, second)
        assert await store.prune_catalogs(*shard, {second.version}) == 1
        with pytest.raises(cs.CatalogError) as info:
            await store.read_catalog(*shard, first.version)
        assert info.value.reason == "CatalogNotFound"
        assert await store.read_catalog(*shard, second.version) == second
