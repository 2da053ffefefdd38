"""Every CacheShard mistake is rejected by the CRD's own schema and CEL rules, naming the field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvshard_operator import crd, validation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))


def full() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "crds" / "examples" / "cacheshard-full.yaml").read_text())


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _del(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


def _both(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        for m in mutations:
            m(obj)

    return mutate


# (id, mutation of the full example, the field the message must name)
MISTAKES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing-spec", _del("spec"), "spec"),
    ("missing-model", _del("spec.model"), "spec.model"),
    ("missing-model-name", _del("spec.model.name"), "spec.model.name"),
    ("missing-capacity", _del("spec.capacityPerPod"), "spec.capacityPerPod"),
    ("clusters-as-string", _set("spec.clusters", "16"), "spec.clusters"),
    ("clusters-negative", _set("spec.clusters", -1), "spec.clusters"),
    ("clusters-zero", _set("spec.clusters", 0), "spec.clusters"),
    ("clusters-float", _set("spec.clusters", 2.5), "spec.clusters"),
    ("clusters-too-many", _set("spec.clusters", 1_000_000), "spec.clusters"),
    ("item-replicas-zero", _set("spec.itemReplicas", 0), "spec.itemReplicas"),
    ("hot-threshold-float", _set("spec.rebalance.hotThresholdPercent", 150.5), "spec.rebalance.hotThresholdPercent"),
    ("interval-too-short", _set("spec.rebalance.intervalSeconds", 1), "spec.rebalance.intervalSeconds"),
    ("enabled-not-bool", _set("spec.rebalance.enabled", "yes"), "spec.rebalance.enabled"),
    ("unknown-builtin-catalog", _set("spec.catalog", {"builtin": "netflix-prize"}), "spec.catalog.builtin"),
    ("unknown-embedding-model", _set("spec.embedding.model", "bert-large"), "spec.embedding.model"),
    ("unknown-history-policy", _set("spec.userHistory.policy", "Sometimes"), "spec.userHistory.policy"),
    ("two-catalog-sources", _set("spec.catalog.builtin", "movielens-100k"), "spec.catalog"),
    ("no-catalog-source", _set("spec.catalog", {}), "spec.catalog"),
    ("relative-catalog-path", _set("spec.catalog", {"file": {"path": "items.jsonl"}}), "spec.catalog.file.path"),
    ("configmap-without-key", _del("spec.catalog.configMap.key"), "spec.catalog.configMap.key"),
    ("configmap-bad-name", _set("spec.catalog.configMap.name", "Shop_Items"), "spec.catalog.configMap.name"),
    ("empty-pod-selector", _set("spec.podSelector", {}), "spec.podSelector"),
    ("bad-label-key", _set("spec.podSelector.matchLabels", {"-bad key": "x"}), "spec.podSelector.matchLabels"),
    ("label-value-too-long", _set("spec.podSelector.matchLabels", {"app": "v" * 64}),
     "spec.podSelector.matchLabels.app"),
    ("unknown-selector-operator", _set("spec.podSelector.matchExpressions.0.operator", "Equals"),
     "spec.podSelector.matchExpressions[0].operator"),
    ("in-without-values", _set("spec.podSelector.matchExpressions.0.values", []),
     "spec.podSelector.matchExpressions[0].values"),
    ("exists-with-values", _set("spec.podSelector.matchExpressions.0.operator", "Exists"),
     "spec.podSelector.matchExpressions[0].values"),
    ("bad-expression-key", _set("spec.podSelector.matchExpressions.0.key", "has space"),
     "spec.podSelector.matchExpressions[0].key"),
    ("capacity-not-a-quantity", _set("spec.capacityPerPod", "lots"), "spec.capacityPerPod"),
    ("capacity-as-integer", _set("spec.capacityPerPod", 1024), "spec.capacityPerPod"),
    ("no-etcd-endpoints", _set("spec.etcd.endpoints", []), "spec.etcd.endpoints"),
    ("etcd-endpoint-with-scheme", _set("spec.etcd.endpoints", ["http://etcd:2379"]), "spec.etcd.endpoints[0]"),
    ("etcd-tls-without-secret", _set("spec.etcd.tls", {"serverName": "etcd.infra"}), "spec.etcd.tls.secretRef"),
    ("etcd-tls-server-name-with-port", _set("spec.etcd.tls.serverName", "etcd:2379"), "spec.etcd.tls.serverName"),
    ("prometheus-url-without-scheme", _set("spec.prometheus.url", "prometheus:9090"), "spec.prometheus.url"),
    ("rebalance-without-prometheus", _del("spec.prometheus"), "spec.prometheus"),
    ("history-budget-with-policy-none", _set("spec.userHistory.policy", "None"), "spec.userHistory.perPodBytes"),
    ("typo-unknown-field", _set("spec.cluster", 8), "spec.cluster"),
    ("oversized-model-name", _set("spec.model.name", "m" * 300), "spec.model.name"),
    ("wrong-api-version", _set("apiVersion", "kvshard.io/v1"), "apiVersion"),
    ("selector-field-typo", _set("spec.podSelector", {"matchLabel": {"app": "x"}}), "spec.podSelector.matchLabel"),
    ("oversized-label-map", _set("spec.podSelector.matchLabels", {f"k{i}": "v" for i in range(40)}),
     "spec.podSelector.matchLabels"),
    ("many-things-at-once", _both(_set("spec.clusters", "x"), _del("spec.etcd")), "spec.etcd"),
    ("prompt-item-format-without-text", _set("spec.prompt", {"itemFormat": "{title} ({brand})"}),
     "spec.prompt.itemFormat"),
    ("prompt-item-format-two-lines", _set("spec.prompt", {"itemFormat": "{text}\n{brand}"}), "spec.prompt.itemFormat"),
    ("prompt-item-format-attribute", _set("spec.prompt", {"itemFormat": "{text} {brand.__class__}"}),
     "spec.prompt.itemFormat"),
    ("prompt-item-format-format-spec", _set("spec.prompt", {"itemFormat": "{text:>40}"}), "spec.prompt.itemFormat"),
    ("prompt-empty-system-text", _set("spec.prompt", {"systemText": ""}), "spec.prompt.systemText"),
    ("prompt-oversized-question", _set("spec.prompt", {"question": "?" * 4001}), "spec.prompt.question"),
    ("prompt-unknown-field", _set("spec.prompt", {"system": "You sell books."}), "spec.prompt.system"),
    ("prompt-label-position", _set("spec.prompt", {"labelPosition": "middle"}), "spec.prompt.labelPosition"),
    ("url-catalog-ftp", _set("spec.catalog", {"url": {"url": "ftp://example.com/items.jsonl"}}),
     "spec.catalog.url.url"),
    ("url-catalog-without-url", _set("spec.catalog", {"url": {"secretRef": {"name": "token"}}}),
     "spec.catalog.url.url"),
    ("url-catalog-bad-secret-name", _set("spec.catalog", {"url": {"url": "https://x.example/i.jsonl",
                                                                  "secretRef": {"name": "Bad_Name"}}}),
     "spec.catalog.url.secretRef.name"),
    ("url-and-builtin-catalog", _set("spec.catalog", {"url": {"url": "https://x.example/i.jsonl"},
                                                      "builtin": "movielens-100k"}), "spec.catalog"),
    ("catalog-refresh-too-often", _set("spec.catalog", {"url": {"url": "https://x.example/i.jsonl"},
                                                        "refreshSeconds": 1}), "spec.catalog.refreshSeconds"),
    ("embeddings-from-file-without-file", _set("spec.catalog.embeddings", {"from": "File"}),
     "spec.catalog.embeddings"),
    ("embeddings-unknown-source", _set("spec.catalog.embeddings", {"from": "Vectors"}), "spec.catalog.embeddings.from"),
    ("embeddings-dimension-one", _set("spec.catalog.embeddings", {"from": "Field", "dimension": 1}),
     "spec.catalog.embeddings.dimension"),
]


def test_a_catalog_with_its_own_vectors_is_valid_and_defaulted() -> None:
    obj = full()
    obj["spec"]["catalog"] = {"file": {"path": "/data/items.jsonl"}, "embeddings": {"from": "Field"}}
    assert validation.validate(obj)["spec"]["catalog"]["embeddings"]["field"] == "embedding"
    obj["spec"]["catalog"]["embeddings"] = {"from": "File", "file": {"path": "/data/vectors.npz"}, "dimension": 128}
    assert validation.violations(obj) == []


def test_a_custom_prompt_and_a_url_catalog_with_a_token_are_valid_and_defaulted() -> None:
    obj = full()
    obj["spec"]["catalog"] = {"url": {"url": "https://catalog.shop.internal/items.jsonl",
                                      "secretRef": {"name": "catalog-token"}}}
    obj["spec"]["prompt"] = {"systemText": "You are a bookshop's recommender.", "itemFormat": "{text} by {author}",
                             "question": "\nWhich book next? Answer with its letter only.", "labelPosition": "after"}
    spec = validation.validate(obj)["spec"]
    assert spec["catalog"]["url"]["secretRef"]["key"] == "token"
    assert spec["catalog"]["refreshSeconds"] == 60


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_manifest_is_valid(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert validation.violations(obj) == []


def test_the_suite_covers_at_least_twenty_different_mistakes() -> None:
    assert len({name for name, _, _ in MISTAKES}) >= 20


@pytest.mark.parametrize(("name", "mutate", "field"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_invalid_cacheshard_is_rejected_naming_the_field(
    name: str, mutate: Callable[[dict[str, Any]], None], field: str
) -> None:
    obj = full()
    mutate(obj)
    with pytest.raises(validation.InvalidCacheShardError) as info:
        validation.validate(obj)
    fields = [v.field for v in info.value.violations]
    assert field in fields, f"{name}: {fields}"
    assert field in str(info.value)


def test_defaults_are_applied_like_the_api_server() -> None:
    obj = yaml.safe_load((ROOT / "crds" / "examples" / "cacheshard-minimal.yaml").read_text())
    spec = validation.validate(obj)["spec"]
    assert spec["itemReplicas"] == 1
    assert spec["model"]["revision"] == "main"
    assert obj["spec"].get("itemReplicas") is None, "validation must not mutate its input"


def test_crd_is_structural_with_conditions_as_a_list_map() -> None:
    schema = crd.version_schema(crd.load_crd())
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    crd_spec = crd.load_crd()["spec"]
    assert crd_spec["names"]["shortNames"] == ["cs"]
    assert crd_spec["versions"][0]["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in crd_spec["versions"][0]["additionalPrinterColumns"]}
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Message"]["priority"] == 1


def test_spec_has_no_float_fields() -> None:
    def types(node: Any) -> list[str]:
        if isinstance(node, dict):
            return [str(node.get("type"))] + [t for v in node.values() for t in types(v)]
        if isinstance(node, list):
            return [t for v in node for t in types(v)]
        return []

    spec = crd.version_schema(crd.load_crd())["properties"]["spec"]
    assert "number" not in types(spec)


def test_validate_spec_returns_a_copy_with_defaults() -> None:
    spec = copy.deepcopy(full()["spec"])
    del spec["itemReplicas"]
    assert validation.validate_spec(spec)["itemReplicas"] == 1


def test_crd_is_a_valid_kubernetes_manifest() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(crd.load_crd(), kv.latest_version(), strict=True)


def test_every_cel_rule_compiles() -> None:
    import celpy

    env = celpy.Environment()
    rules: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            rules.extend(r["rule"] for r in node.get("x-kubernetes-validations", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(crd.version_schema(crd.load_crd()))
    assert len(rules) >= 5
    for rule in rules:
        env.compile(rule)
