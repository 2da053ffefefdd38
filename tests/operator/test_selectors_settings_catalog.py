"""Pod selection, settings from the environment, and catalog sources."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvshard_operator import catalog, selectors
from kvshard_operator.settings import Settings, add_arguments

POD = {"app": "engine", "tier": "gpu"}


@pytest.mark.parametrize(("selector", "expected"), [
    ({"matchLabels": {"app": "engine"}}, True),
    ({"matchLabels": {"app": "other"}}, False),
    ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu", "cpu"]}]}, True),
    ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gpu"]}]}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, True),
    ({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, False),
    ({"matchLabels": {"app": "engine"}, "matchExpressions": [{"key": "tier", "operator": "Exists"}]}, True),
    ({}, False),
])
def test_selector_matches_like_kubectl(selector: dict[str, object], expected: bool) -> None:
    assert selectors.matches(selector, POD) is expected


def test_unknown_selector_operator_is_an_error() -> None:
    with pytest.raises(selectors.SelectorError):
        selectors.matches({"matchExpressions": [{"key": "a", "operator": "Near"}]}, POD)


def test_settings_come_from_the_environment_then_flags() -> None:
    settings = Settings.from_env({"KVSHARD_OPERATOR_SEED": "7", "KVSHARD_OPERATOR_PEERING": "true",
                                  "KVSHARD_OPERATOR_NAMESPACES": "a, b", "KVSHARD_OPERATOR_POD_SYNC_SECONDS": "0.5"})
    assert (settings.seed, settings.peering, settings.namespaces) == (7, True, ("a", "b"))
    assert settings.pod_sync_seconds == 0.5
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flagged = settings.with_args(parser.parse_args(["-n", "c", "--no-peering", "--seed", "3"]))
    assert (flagged.seed, flagged.peering, flagged.namespaces) == (3, False, ("c",))
    assert flagged.metrics_port == settings.metrics_port


def test_a_malformed_setting_names_its_variable() -> None:
    with pytest.raises(ValueError, match="KVSHARD_OPERATOR_SEED"):
        Settings.from_env({"KVSHARD_OPERATOR_SEED": "many"})


def test_jsonl_file_catalog_keeps_order(tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    path.write_text('{"id": "b", "text": "second"}\n\n{"id": 3, "text": "third"}\n')
    cat = catalog.load_catalog({"file": {"path": str(path)}}, "ns")
    assert (cat.ids, cat.texts) == (("b", "3"), ("second", "third"))


@pytest.mark.parametrize(("text", "reason"), [
    ("not json\n", "CatalogInvalid"),
    ('{"id": "a"}\n', "CatalogInvalid"),
    ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "CatalogInvalid"),
    ("\n", "CatalogEmpty"),
])
def test_bad_jsonl_is_a_catalog_error_with_a_reason(text: str, reason: str) -> None:
    with pytest.raises(catalog.CatalogError) as info:
        catalog.parse_jsonl(text, "items.jsonl")
    assert info.value.reason == reason


def test_missing_file_is_catalog_not_found(tmp_path: Path) -> None:
    with pytest.raises(catalog.CatalogError) as info:
        catalog.load_catalog({"file": {"path": str(tmp_path / "nope.jsonl")}}, "ns")
    assert info.value.reason == "CatalogNotFound"


def test_configmap_catalog_reads_the_named_key() -> None:
    data = {"items.jsonl": json.dumps({"id": "x", "text": "hello"})}
    cat = catalog.load_catalog({"configMap": {"name": "cm", "key": "items.jsonl"}}, "ns", lambda ns, name: data)
    assert cat.ids == ("x",)
    with pytest.raises(catalog.CatalogError, match="no key"):
        catalog.load_catalog({"configMap": {"name": "cm", "key": "other"}}, "ns", lambda ns, name: data)


def test_builtin_movielens_catalog_has_items_and_histories() -> None:
    try:
        cat = catalog.load_catalog({"builtin": "movielens-100k"}, "ns")
    except catalog.CatalogError as exc:
        pytest.skip(f"MovieLens data not installed: {exc}")
    assert len(cat) == 1682
    assert len(cat.histories) == 943
