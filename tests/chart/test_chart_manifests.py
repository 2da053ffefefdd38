"""Unit tests on the rendered manifests: labels, names, least-privilege RBAC, restricted pods, the
vLLM connector wiring, the shared /dev/shm, the peer token, placement following (router and
sidecars on one CacheShard), autoscaling and network policy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from chart_helpers import (
    VALUES_CASES,
    Manifest,
    container,
    containers,
    engine_pod,
    env,
    find,
    kind_name,
    pod_spec,
    pod_specs,
    render,
    resolved_env,
)

RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                      "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
                      "helm.sh/chart")


@pytest.mark.parametrize("case", VALUES_CASES)
def test_every_object_and_pod_carries_the_recommended_labels(rendered: dict[str, list[Manifest]], case: str) -> None:
    for obj in rendered[case]:
        labels = obj["metadata"].get("labels", {})
        missing = [k for k in RECOMMENDED_LABELS if k not in labels]
        assert missing == [], f"{kind_name(obj)} lacks {missing}"
        assert labels["app.kubernetes.io/part-of"] == "kvshard"
        assert labels["app.kubernetes.io/instance"] == "kvs"
    for where, _ in pod_specs(rendered[case]):
        workload = next(o for o in rendered[case] if kind_name(o) == where)
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert all(k in pod_labels for k in RECOMMENDED_LABELS), where
        assert workload["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), where


def test_names_and_labels_fit_63_characters_for_the_longest_release_name(helm_bin: Path) -> None:
    release = "r" * 53  # Helm's own limit on release names
    objects = render(helm_bin, VALUES_CASES["autoscaling"], release=release)
    for obj in objects:
        assert len(obj["metadata"]["name"]) <= 63, kind_name(obj)
        assert all(len(v) <= 63 for v in obj["metadata"]["labels"].values()), kind_name(obj)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] != "Role" and o["kind"] != "RoleBinding"]
    assert len(names) == len(set(names)), "truncation made two names collide"


# ----------------------------------------------------------------------------------------------
# RBAC: exactly what kopf and the handlers need. Each verb and its reason:
#   customresourcedefinitions list, watch  kopf's resource observer (CRD added/upgraded after start)
#   namespaces list, watch                  kopf's namespace observer (only with watchNamespaces)
#   cacheshards list, watch                 kopf watches CacheShards (handlers, timers)
#   cacheshards patch                       finalizer + kopf progress/diff-base annotations
#   cacheshards/status patch                conditions, placementGeneration, counts
#   pods list, watch                        the pod index (ready pods selected by spec.podSelector)
#   configmaps get                          spec.catalog.configMap
#   secrets get, list, watch                the operator's Secret index of spec.etcd.secretRef (username/password)
#                                           and spec.etcd.tls.secretRef (CA, client certificate); get for the
#                                           catalog URL token and an etcd Secret not yet indexed
#   events create                           kopf posts handler warnings/errors as Events
# ----------------------------------------------------------------------------------------------
Rule = tuple[str, str, frozenset[str]]
NAMESPACED_RULES: set[Rule] = {
    ("kvshard.io", "cacheshards", frozenset({"list", "watch", "patch"})),
    ("kvshard.io", "cacheshards/status", frozenset({"patch"})),
    ("", "pods", frozenset({"list", "watch"})),
    ("", "configmaps", frozenset({"get"})),
    ("", "secrets", frozenset({"get", "list", "watch"})),
    ("", "events", frozenset({"create"})),
}
CRD_DISCOVERY: Rule = ("apiextensions.k8s.io", "customresourcedefinitions", frozenset({"list", "watch"}))
NAMESPACE_DISCOVERY: Rule = ("", "namespaces", frozenset({"list", "watch"}))


def _rules(role: Manifest) -> set[Rule]:
    out: set[Rule] = set()
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.add((group, resource, frozenset(rule["verbs"])))
    return out


def test_operator_rbac_watching_every_namespace_is_exactly_what_kopf_needs(
        rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["default"]
    assert _rules(find(objects, "ClusterRole", "-operator")) == NAMESPACED_RULES | {CRD_DISCOVERY}
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding")]
    binding = find(objects, "ClusterRoleBinding", "-operator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvs-kvshard-operator", "namespace": "recommend"}]


def test_operator_rbac_watching_listed_namespaces_uses_one_role_per_namespace(
        rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["external-etcd"]
    assert _rules(find(objects, "ClusterRole", "-operator")) == {CRD_DISCOVERY, NAMESPACE_DISCOVERY}
    roles = [o for o in objects if o["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["recommend", "recommend-canary"]
    for role in roles:
        assert _rules(role) == NAMESPACED_RULES
    bindings = [o for o in objects if o["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["recommend", "recommend-canary"]
    operator = container(find(objects, "Deployment", "-operator")["spec"]["template"]["spec"], "operator")
    assert env(operator)["KVSHARD_OPERATOR_NAMESPACES"] == "recommend,recommend-canary"


def test_no_rbac_grants_wildcards_or_write_access_beyond_patch(rendered: dict[str, list[Manifest]]) -> None:
    for case in VALUES_CASES:
        for role in (o for o in rendered[case] if o["kind"] in ("Role", "ClusterRole")):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
                forbidden = {"delete", "deletecollection", "update", "escalate", "bind", "impersonate"}
                assert not forbidden & set(rule["verbs"]), rule


@pytest.mark.parametrize("case", ["default", "autoscaling"])
def test_only_the_operator_gets_a_kubernetes_api_token(rendered: dict[str, list[Manifest]], case: str) -> None:
    for where, pod in pod_specs(rendered[case]):
        if where.endswith("-operator"):
            assert pod["serviceAccountName"] == "kvs-kvshard-operator"
        else:
            assert pod["automountServiceAccountToken"] is False, where


# ----------------------------------------------------------------------------------------------
# Restricted Pod Security on every pod and container.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", VALUES_CASES)
def test_every_container_runs_restricted(rendered: dict[str, list[Manifest]], case: str) -> None:
    for where, pod in pod_specs(rendered[case]):
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] > 0, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, (where, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (where, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (where, c["name"])
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, (where, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert not sc.get("privileged"), (where, c["name"])
            assert "memory" in c["resources"]["limits"], (where, c["name"])
        assert not any("hostPath" in v for v in pod.get("volumes", [])), where


# ----------------------------------------------------------------------------------------------
# The engine pod: vLLM with the kvshard connector beside the sidecar, sharing /dev/shm.
# ----------------------------------------------------------------------------------------------
def test_vllm_container_loads_the_kvshard_connector(rendered: dict[str, list[Manifest]]) -> None:
    pod = engine_pod(rendered["default"])
    vllm = container(pod, "vllm")
    assert vllm["command"] == ["vllm", "serve"]
    args = vllm["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "KvshardConnector",
        "kv_connector_module_path": "kvshard_sidecar.vllm.connector",
        "kv_role": "kv_both",
        # a vanished or corrupt exchange entry is recomputed by vLLM, never a failed request
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"exchange_dir": "/dev/shm/kvshard-exchange"},
    }
    assert args[0] == env(container(pod, "sidecar"))["KVSHARD_SIDECAR_MODEL"], "both containers load one model"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_a_block_trained_scorer_is_computed_by_vllm_from_the_pods_block_store(
        rendered: dict[str, list[Manifest]]) -> None:
    """engine.model.scorer late: vLLM keeps its prefix cache (everything loaded is exact), reads and writes
    blocks in the disk tier the sidecar uses, and fails a request whose block cannot be loaded (the sidecar
    warms it again) rather than computing an item body causally."""
    pod = engine_pod(rendered["late-scorer"])
    vllm, sidecar = container(pod, "vllm"), container(pod, "sidecar")
    args = vllm["args"]
    assert "--enable-prefix-caching" in args and "--no-enable-prefix-caching" not in args
    assert "--max-num-seqs=256" in args
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_load_failure_policy"] == "fail"
    block_dir = config["kv_connector_extra_config"]["block_dir"]
    sidecar_env = env(sidecar)
    assert block_dir == sidecar_env["KVSHARD_SIDECAR_DISK_DIR"]
    assert config["kv_connector_extra_config"]["block_bytes"] == int(sidecar_env["KVSHARD_SIDECAR_DISK_BYTES"])
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (vllm, sidecar)}
    assert mounts["vllm"]["blocks"] == mounts["sidecar"]["blocks"] and block_dir.startswith(mounts["vllm"]["blocks"])
    assert sidecar_env["KVSHARD_SIDECAR_VLLM_CONCURRENCY"] == "8"
    assert sidecar_env["KVSHARD_SIDECAR_VLLM_MAX_NUM_SEQS"] == "256"  # its pressure reads vLLM's queue against it
    default = container(engine_pod(rendered["default"]), "vllm")
    assert "--no-enable-prefix-caching" in default["args"] and "blocks" not in {
        m["name"] for m in default["volumeMounts"]}


def test_kind_values_run_on_cpu_with_the_baked_in_model(rendered: dict[str, list[Manifest]]) -> None:
    pod = engine_pod(rendered["kind"])
    for c in containers(pod):
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), c["name"]
    assert [c["name"] for c in containers(pod)] == ["vllm", "sidecar"], "no model download on kind"
    vllm = container(pod, "vllm")
    assert vllm["args"][0] == "/opt/kvshard/models/SmolLM2-135M-MovieLens-Rec"  # merged into the image beside the base
    assert "--served-model-name=SmolLM2-135M-MovieLens-Rec" in vllm["args"]
    assert {"--dtype=float32", "--enforce-eager", "--gpu-memory-utilization=0.2"} <= set(vllm["args"])
    assert env(container(pod, "sidecar"))["KVSHARD_SIDECAR_DEVICE"] == "cpu"


def test_sidecar_decodes_through_the_local_vllm_and_the_same_exchange(rendered: dict[str, list[Manifest]]) -> None:
    pod = engine_pod(rendered["default"])
    sidecar_env = env(container(pod, "sidecar"))
    vllm = container(pod, "vllm")
    assert sidecar_env["KVSHARD_SIDECAR_ENGINE"] == "vllm"
    assert sidecar_env["KVSHARD_SIDECAR_VLLM_URL"] == "http://127.0.0.1:8000"
    assert "--port=8000" in vllm["args"]
    exchange = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    assert sidecar_env["KVSHARD_SIDECAR_EXCHANGE_DIR"] == exchange["kv_connector_extra_config"]["exchange_dir"]
    assert sidecar_env["KVSHARD_SIDECAR_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_dev_shm_is_one_in_memory_volume_shared_by_both_containers(rendered: dict[str, list[Manifest]]) -> None:
    pod = engine_pod(rendered["default"])
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    for name in ("vllm", "sidecar"):
        mounts = {m["mountPath"]: m for m in container(pod, name)["volumeMounts"]}
        assert mounts["/dev/shm"]["name"] == "shm" and not mounts["/dev/shm"].get("readOnly")


def test_peer_token_comes_from_a_mounted_secret(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["default"]
    secret = find(objects, "Secret", "-peer-token")
    assert set(secret["data"]) == {"token"}
    pod = engine_pod(objects)
    volume = next(v for v in pod["volumes"] if v["name"] == "peer-token")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    sidecar = container(pod, "sidecar")
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "peer-token")
    assert mount["readOnly"] is True
    assert env(sidecar)["KVSHARD_SIDECAR_PEER_TOKEN_FILE"] == mount["mountPath"] + "/token"
    assert "KVSHARD_SIDECAR_PEER_TOKEN" not in env(sidecar), "the token itself never sits in the pod spec"
    assert not any(m["name"] == "peer-token" for m in container(pod, "vllm")["volumeMounts"])


def test_an_existing_peer_token_secret_replaces_the_generated_one(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["external-etcd"]
    assert not [o for o in objects if o["kind"] == "Secret"]
    volume = next(v for v in engine_pod(objects)["volumes"] if v["name"] == "peer-token")
    assert volume["secret"]["secretName"] == "kvshard-peer-token"


def test_static_sidecar_peers_only_when_asked_for_by_stable_dns(rendered: dict[str, list[Manifest]],
                                                                helm_bin: Path) -> None:
    for case in VALUES_CASES:
        assert "KVSHARD_SIDECAR_PEERS" not in env(container(engine_pod(rendered[case]), "sidecar")), (
            f"{case}: sidecars follow placement, a static peer list is only rendered on request")
    asked = env(container(engine_pod(render(helm_bin, sets=["engine.peers=true"])), "sidecar"))
    peers = asked["KVSHARD_SIDECAR_PEERS"].split(",")
    assert peers == [f"http://kvs-kvshard-engine-{i}.kvs-kvshard-engine-peers.recommend.svc:8100" for i in range(2)]
    autoscaled = render(helm_bin, VALUES_CASES["autoscaling"], sets=["engine.peers=true"])
    assert len(env(container(engine_pod(autoscaled), "sidecar"))["KVSHARD_SIDECAR_PEERS"].split(",")) == 6, (
        "autoscaling lists every pod up to maxReplicas")


def test_engine_readiness_waits_for_the_model_and_vllm(rendered: dict[str, list[Manifest]]) -> None:
    pod = engine_pod(rendered["default"])
    assert container(pod, "sidecar")["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container(pod, "vllm")["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container(pod, "fetch-model")["command"][-3:] == [
        "/models/model", "HuggingFaceTB/SmolLM2-135M-Instruct", "main"]


@pytest.mark.parametrize("case", VALUES_CASES)
def test_container_settings_are_real_settings_of_the_commands(rendered: dict[str, list[Manifest]],
                                                              case: str) -> None:
    from kvshard_operator.settings import Settings as OperatorSettings
    from kvshard_router.settings import RouterSettings
    from kvshard_sidecar.settings import SidecarSettings

    objects = rendered[case]
    workloads = [(engine_pod(objects), "sidecar", "KVSHARD_SIDECAR_", SidecarSettings),
                 (pod_spec(objects, "Deployment", "-operator"), "operator", "KVSHARD_OPERATOR_", OperatorSettings),
                 (pod_spec(objects, "Deployment", "-router"), "router", "KVSHARD_ROUTER_", RouterSettings)]
    for pod, name, prefix, settings in workloads:
        fields = {f"{prefix}{f.name.upper()}" for f in dataclasses.fields(settings)}
        used = {k for k in env(container(pod, name)) if k.startswith(prefix)}
        assert used and used <= fields, (name, used - fields)


# ----------------------------------------------------------------------------------------------
# Operator, autoscaling, network policy, router.
# ----------------------------------------------------------------------------------------------
def test_operator_is_one_replica_replaced_not_rolled_with_a_liveness_probe(rendered: dict[str, list[Manifest]]) -> None:
    deployment = find(rendered["default"], "Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    operator = container(deployment["spec"]["template"]["spec"], "operator")
    assert operator["args"] == ["operator", "run"]
    assert operator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    ports = {p["name"]: p["containerPort"] for p in operator["ports"]}
    assert env(operator)["KVSHARD_OPERATOR_LIVENESS_ENDPOINT"] == f"http://0.0.0.0:{ports['healthz']}/healthz"
    assert env(operator)["KVSHARD_OPERATOR_METRICS_PORT"] == str(ports["metrics"])
    assert env(operator)["KVSHARD_OPERATOR_PEERING"] == "false"


def test_autoscaled_engine_leaves_replicas_to_the_hpa(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["autoscaling"]
    assert "replicas" not in find(objects, "StatefulSet", "-engine")["spec"]
    hpa = find(objects, "HorizontalPodAutoscaler")
    target = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "kvs-kvshard-engine"}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert hpa["spec"]["metrics"][0]["type"] == "Pods"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "kvshard_sidecar_pressure"
    keda = find(rendered["autoscaling-keda"], "ScaledObject")
    assert keda["spec"]["scaleTargetRef"]["name"] == "kvs-kvshard-engine"
    assert not [o for o in rendered["autoscaling-keda"] if o["kind"] == "HorizontalPodAutoscaler"]
    assert find(rendered["default"], "StatefulSet", "-engine")["spec"]["replicas"] == 2


def test_only_router_and_peer_sidecars_reach_the_sidecar_api(rendered: dict[str, list[Manifest]]) -> None:
    policy = find(rendered["default"], "NetworkPolicy", "-engine")
    api_rule, metrics_rule = policy["spec"]["ingress"]
    components = sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in api_rule["from"])
    assert components == ["engine", "router"]
    assert all(p["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "kvs" for p in api_rule["from"])
    assert api_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert list(metrics_rule["from"][0]) == ["namespaceSelector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_services_select_pods_that_exist(rendered: dict[str, list[Manifest]]) -> None:
    for case in VALUES_CASES:
        pod_labels = [o["spec"]["template"]["metadata"]["labels"] for o in rendered[case]
                      if o["kind"] in ("Deployment", "StatefulSet")]
        for service in (o for o in rendered[case] if o["kind"] == "Service"):
            selector = service["spec"]["selector"].items()
            assert any(selector <= labels.items() for labels in pod_labels), kind_name(service)


# ----------------------------------------------------------------------------------------------
# Placement following: the router and every sidecar follow one CacheShard through etcd.
# ----------------------------------------------------------------------------------------------
POD_IP = "10.244.1.7"
ENGINE_POD = {"metadata.name": "kvs-kvshard-engine-1", "status.podIP": POD_IP}
ETCD_AUTH = {("kvshard-etcd-auth", "username"): "kvshard", ("kvshard-etcd-auth", "password"): "s3cret"}


def _router_settings(objects: list[Manifest]) -> Any:
    from kvshard import settings as settings_lib
    from kvshard_router.settings import ENV_PREFIX, RouterSettings

    environ = resolved_env(container(pod_spec(objects, "Deployment", "-router"), "router"), field_refs={},
                           secrets=ETCD_AUTH)
    return settings_lib.from_sources(RouterSettings, None, ENV_PREFIX, environ)


def _sidecar_settings(objects: list[Manifest]) -> Any:
    from kvshard import settings as settings_lib
    from kvshard_sidecar.settings import ENV_PREFIX, SidecarSettings

    environ = resolved_env(container(engine_pod(objects), "sidecar"), field_refs=ENGINE_POD, secrets=ETCD_AUTH)
    return settings_lib.from_sources(SidecarSettings, None, ENV_PREFIX, environ)


def test_router_is_on_by_default_and_follows_the_example_cacheshard(rendered: dict[str, list[Manifest]]) -> None:
    router = find(rendered["default"], "Deployment", "-router")
    spec = container(router["spec"]["template"]["spec"], "router")
    assert spec["args"] == ["router", "serve"]
    assert "KVSHARD_ROUTER_ENGINE_SERVICE" not in env(spec)
    # The CacheShard the example renders (same release, same namespace) is the one the router follows.
    example = find(rendered["autoscaling"], "CacheShard")
    shard = f"{example['metadata']['namespace']}/{example['metadata']['name']}"
    assert shard == "recommend/kvs-kvshard-movielens"
    settings = _router_settings(rendered["default"])
    assert settings.cacheshard == shard
    assert settings.shard() == ("recommend", "kvs-kvshard-movielens")
    assert list(settings.etcd_endpoints) == example["spec"]["etcd"]["endpoints"]
    assert settings.host == "0.0.0.0" and settings.port == 8200 and settings.policy == "affinity"
    assert settings.etcd_username == "" and settings.etcd_password == ""
    probes = {p: spec[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")}
    assert probes == {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}


def test_engine_sidecars_follow_the_same_cacheshard_and_advertise_their_pod_ip(
        rendered: dict[str, list[Manifest]]) -> None:
    for case in VALUES_CASES:
        router, sidecar = _router_settings(rendered[case]), _sidecar_settings(rendered[case])
        assert sidecar.cacheshard == router.cacheshard == "recommend/kvs-kvshard-movielens", case
        assert sidecar.etcd_endpoints == router.etcd_endpoints, case
    sidecar_env = env(container(engine_pod(rendered["default"]), "sidecar"))
    assert sidecar_env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert sidecar_env["KVSHARD_SIDECAR_ADVERTISE_URL"] == "http://$(POD_IP):8100"
    names = list(sidecar_env)
    assert names.index("POD_IP") < names.index("KVSHARD_SIDECAR_ADVERTISE_URL"), (
        "$(POD_IP) expands only from a variable defined earlier in the list")
    settings = _sidecar_settings(rendered["default"])
    assert settings.etcd_endpoints == ("kvs-kvshard-etcd.recommend.svc:2379",)
    assert settings.url == f"http://{POD_IP}:8100", "the URL others reach this sidecar at is its pod IP"
    assert settings.name == "kvs-kvshard-engine-1", "placement assigns clusters by pod name"
    assert settings.warm_history_users == 0
    assert settings.etcd_username == "" and settings.etcd_password == ""


def test_one_cacheshard_name_for_example_router_and_sidecars(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=["cacheShard.name=movies-prod", "exampleCacheShard.enabled=true",
                                     "router.policy=least-loaded", "engine.sidecar.warmHistoryUsers=50"],
                     namespace="shop")
    assert find(objects, "CacheShard")["metadata"]["name"] == "movies-prod"
    router, sidecar = _router_settings(objects), _sidecar_settings(objects)
    assert router.cacheshard == sidecar.cacheshard == "shop/movies-prod"
    assert router.policy == "least-loaded"
    assert sidecar.warm_history_users == 50


def test_external_etcd_credentials_come_from_the_secret_never_the_pod_spec(
        rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["external-etcd"]
    endpoints = ("etcd-0.etcd.infra.svc:2379", "etcd-1.etcd.infra.svc:2379", "etcd-2.etcd.infra.svc:2379")
    for spec, prefix in ((container(pod_spec(objects, "Deployment", "-router"), "router"), "KVSHARD_ROUTER_"),
                         (container(engine_pod(objects), "sidecar"), "KVSHARD_SIDECAR_")):
        for key in ("username", "password"):
            assert env(spec)[f"{prefix}ETCD_{key.upper()}"] == {
                "secretKeyRef": {"name": "kvshard-etcd-auth", "key": key}}, (prefix, key)
    for settings in (_router_settings(objects), _sidecar_settings(objects)):
        assert settings.etcd_endpoints == endpoints
        assert (settings.etcd_username, settings.etcd_password) == ("kvshard", "s3cret")
    assert find(objects, "CacheShard")["spec"]["etcd"]["secretRef"] == {"name": "kvshard-etcd-auth"}
    for case in ("default", "autoscaling"):  # bundled etcd: no authentication, no Secret reference
        for spec in (container(engine_pod(rendered[case]), "sidecar"),
                     container(pod_spec(rendered[case], "Deployment", "-router"), "router")):
            assert not [k for k in env(spec) if k.endswith(("_ETCD_USERNAME", "_ETCD_PASSWORD"))], case


def test_router_off_renders_no_router_objects_and_the_sidecars_still_follow_placement(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=["router.enabled=false"])
    assert not [kind_name(o) for o in objects if o["metadata"]["name"].endswith("-router")]
    assert _sidecar_settings(objects).cacheshard == "recommend/kvs-kvshard-movielens"


def test_router_servicemonitor_keeps_the_routers_own_pod_label(rendered: dict[str, list[Manifest]]) -> None:
    monitor = find(rendered["default"], "ServiceMonitor", "-router")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True, "else `pod` (the answering engine pod) becomes `exported_pod`"
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    service = find(rendered["default"], "Service", "-router")
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    for name in ("-engine", "-operator"):  # their samples carry no `pod` label of their own
        for other in find(rendered["default"], "ServiceMonitor", name)["spec"]["endpoints"]:
            assert not other.get("honorLabels"), name


def _admits(policy: Manifest, pod_labels: dict[str, str], port: str) -> bool:
    """Whether ``policy``'s ingress lets a pod with ``pod_labels`` (same namespace) in on ``port``."""
    from kvshard_operator import selectors

    for rule in policy["spec"]["ingress"]:
        peers = [p for p in rule["from"] if set(p) == {"podSelector"}]
        if any(selectors.matches(p["podSelector"], pod_labels) for p in peers) and any(
                p["port"] == port for p in rule["ports"]):
            return True
    return False


def _pod_labels(objects: list[Manifest], kind: str, name_suffix: str) -> dict[str, str]:
    return dict(find(objects, kind, name_suffix)["spec"]["template"]["metadata"]["labels"])


def test_network_policy_lets_router_and_sidecars_reach_what_they_follow(rendered: dict[str, list[Manifest]]) -> None:
    from kvshard_operator import selectors

    objects = rendered["default"]
    router = _pod_labels(objects, "Deployment", "-router")
    engine = _pod_labels(objects, "StatefulSet", "-engine")
    operator = _pod_labels(objects, "Deployment", "-operator")
    etcd_policy = find(objects, "NetworkPolicy", "-etcd")
    engine_policy = find(objects, "NetworkPolicy", "-engine")
    assert selectors.matches(etcd_policy["spec"]["podSelector"], _pod_labels(objects, "StatefulSet", "-etcd"))
    assert selectors.matches(engine_policy["spec"]["podSelector"], engine)
    # The named ports the rules admit are the ports the containers serve.
    etcd_ports = {p["name"] for p in container(pod_spec(objects, "StatefulSet", "-etcd"), "etcd")["ports"]}
    assert "client" in etcd_ports
    assert "http" in {p["name"] for p in container(engine_pod(objects), "sidecar")["ports"]}
    for who, labels in (("router", router), ("engine", engine), ("operator", operator)):
        assert _admits(etcd_policy, labels, "client"), f"{who} pods must reach etcd's client port"
    assert _admits(engine_policy, router, "http"), "the router forwards to the sidecar API"
    assert _admits(engine_policy, engine, "http"), "peer sidecars fetch blocks from each other"
    assert not _admits(engine_policy, operator, "http")
    assert not _admits(etcd_policy, router, "peer")
