"""The chart as a Gateway API Inference Extension backend (issue 43): with
``gatewayApi.inferencePool.enabled`` it renders an ``InferencePool`` of the engine pods that the
Inference Extension's own CRD (v1.6.0, vendored in ``schemas/``) accepts, and kvshard's endpoint
picker (``kvshard router epp``) with the router's settings, etcd access and no Kubernetes API access;
the NetworkPolicies let the gateway's proxies in and nothing else; NOTES wire an ``HTTPRoute`` to the
pool. Off (the default), none of it renders. The checkov gate and kubernetes-validate cover the
``gateway-api`` values case with the other cases (test_chart_checkov.py, test_chart_render.py)."""

from __future__ import annotations

import copy
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    KUBERNETES_VERSION,
    NAMESPACE,
    RELEASE,
    VALUES_CASES,
    HelmError,
    Manifest,
    container,
    engine_pod,
    find,
    helm,
    kind_name,
    pod_spec,
    pod_specs,
    render,
    resolved_env,
)

from kvshard import crd_validation

GATEWAY_VALUES = VALUES_CASES["gateway-api"]
CRD_FILE = Path(__file__).parent / "schemas" / "inferencepool-crd.yaml"
POOL_API = "inference.networking.k8s.io/v1"
ON = "gatewayApi.inferencePool.enabled=true"


def _pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    assert crd["spec"]["group"] == "inference.networking.k8s.io"
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert served["served"] and served["storage"]
    schema: dict[str, Any] = served["schema"]["openAPIV3Schema"]
    return schema


def _violations(pool: Manifest) -> list[str]:
    """Every rejection of the vendored CRD's openAPIV3Schema and CEL rules, as the API server would."""
    found = crd_validation.violations(pool, _pool_schema(), api_version=POOL_API, kind="InferencePool")
    return [str(v) for v in found]


@pytest.fixture(scope="module")
def objects(rendered: dict[str, list[Manifest]]) -> list[Manifest]:
    return rendered["gateway-api"]


def _render_overlay(helm_bin: Path, tmp_path: Path, overlay: dict[str, Any], base: Path | None = GATEWAY_VALUES,
                    ) -> list[Manifest]:
    """The chart rendered with ``base`` and then ``overlay`` (values that ``--set`` would turn into numbers)."""
    path = tmp_path / "overlay.yaml"
    path.write_text(yaml.safe_dump(overlay))
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBERNETES_VERSION]
    args += ["-f", str(base)] if base else []
    return [d for d in yaml.safe_load_all(helm(helm_bin, *args, "-f", str(path))) if d]


def _port(ports: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [p for p in ports if p["name"] == name]
    return found


# ----------------------------------------------------------------------------------------------
# Off by default.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in VALUES_CASES if c != "gateway-api"])
def test_option_off_renders_no_pool_no_endpoint_picker_and_no_rule_for_them(
        rendered: dict[str, list[Manifest]], case: str) -> None:
    assert not [o for o in rendered[case] if o["kind"] == "InferencePool"]
    assert not [kind_name(o) for o in rendered[case] if o["metadata"]["name"].endswith("-epp")]
    text = yaml.safe_dump_all(rendered[case])
    assert "component: epp" not in text and "inference.networking.k8s.io" not in text


# ----------------------------------------------------------------------------------------------
# The InferencePool.
# ----------------------------------------------------------------------------------------------
def test_inference_pool_passes_the_inference_extension_crd_schema_and_cel_rules(objects: list[Manifest]) -> None:
    pool = find(objects, "InferencePool")
    assert pool["apiVersion"] == POOL_API
    assert _violations(pool) == []


@pytest.mark.parametrize(("change", "rejected"), [
    (lambda s: s.pop("targetPorts"), "spec.targetPorts: Required value"),
    (lambda s: s["targetPorts"].append({"number": s["targetPorts"][0]["number"]}), "port number must be unique"),
    (lambda s: s["endpointPickerRef"].pop("port"), "port is required when kind is 'Service'"),
    (lambda s: s["endpointPickerRef"].update(failureMode="Open"), "spec.endpointPickerRef.failureMode"),
    (lambda s: s.update(targetPortNumber=8100), "spec.targetPortNumber: unknown field"),
])
def test_the_crd_check_rejects_a_broken_pool(objects: list[Manifest], change: Any, rejected: str) -> None:
    pool = copy.deepcopy(find(objects, "InferencePool"))
    change(pool["spec"])
    assert any(rejected in v for v in _violations(pool)), _violations(pool)


def test_pool_selects_exactly_the_engine_pods(objects: list[Manifest]) -> None:
    selector = find(objects, "InferencePool")["spec"]["selector"]["matchLabels"]
    assert selector == find(objects, "Service", "-engine")["spec"]["selector"], "the engine Service's pods"
    assert selector == find(objects, "StatefulSet", "-engine")["spec"]["selector"]["matchLabels"]
    for where, _ in pod_specs(objects):
        workload = next(o for o in objects if kind_name(o) == where)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert (selector.items() <= labels.items()) == (where == "StatefulSet/kvs-kvshard-engine"), where
    for job in (o for o in objects if o["kind"] == "CronJob"):
        assert not selector.items() <= job["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("sets", [[], ["engine.sidecar.port=9100"]])
def test_pool_targets_the_sidecar_port_requests_go_to(helm_bin: Path, sets: list[str]) -> None:
    objects = render(helm_bin, GATEWAY_VALUES, sets=sets)
    pool = find(objects, "InferencePool")
    sidecar = container(engine_pod(objects), "sidecar")
    port = next(p["containerPort"] for p in sidecar["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    # The EPP names a pod by the address its sidecar advertises in etcd: the same port.
    advertised = resolved_env(sidecar, field_refs={"metadata.name": "kvs-kvshard-engine-0",
                                                   "status.podIP": "10.1.2.3"})["KVSHARD_SIDECAR_ADVERTISE_URL"]
    assert advertised == f"http://10.1.2.3:{port}"
    # vLLM's port is not the pool's: only the sidecar beside it calls vLLM.
    vllm = container(engine_pod(objects), "vllm")
    assert {"number": vllm["ports"][0]["containerPort"]} not in pool["spec"]["targetPorts"]


def test_endpoint_picker_ref_names_the_epp_service_and_its_grpc_port(objects: list[Manifest]) -> None:
    ref = find(objects, "InferencePool")["spec"]["endpointPickerRef"]
    service = find(objects, "Service", "-epp")
    assert (ref["group"], ref["kind"], ref["name"]) == ("", "Service", service["metadata"]["name"])
    grpc = _port(service["spec"]["ports"], "grpc")
    assert ref["port"] == {"number": grpc["port"]} and grpc["port"] == 9002
    assert grpc["appProtocol"] == "kubernetes.io/h2c", "ext_proc is gRPC: HTTP/2 in cleartext"
    assert ref["failureMode"] == "FailOpen"
    epp = pod_spec(objects, "Deployment", "-epp")
    assert service["spec"]["selector"].items() <= find(objects, "Deployment", "-epp")["spec"]["template"][
        "metadata"]["labels"].items()
    assert _port(container(epp, "epp")["ports"], grpc["targetPort"])["containerPort"] == 9002


def test_epp_port_and_failure_mode_follow_the_values(helm_bin: Path) -> None:
    objects = render(helm_bin, GATEWAY_VALUES,
                     sets=["gatewayApi.epp.port=9102", "gatewayApi.epp.failureMode=FailClose"])
    ref = find(objects, "InferencePool")["spec"]["endpointPickerRef"]
    assert ref["port"] == {"number": 9102} and ref["failureMode"] == "FailClose"
    assert _port(find(objects, "Service", "-epp")["spec"]["ports"], "grpc")["port"] == 9102
    epp = container(pod_spec(objects, "Deployment", "-epp"), "epp")
    assert _port(epp["ports"], "grpc")["containerPort"] == 9102
    assert {e["name"]: e.get("value") for e in epp["env"]}["KVSHARD_ROUTER_EPP_PORT"] == "9102"


# ----------------------------------------------------------------------------------------------
# The endpoint picker: the router's process, settings and etcd access.
# ----------------------------------------------------------------------------------------------
def _router_and_epp(objects: list[Manifest]) -> tuple[Manifest, Manifest, Manifest, Manifest]:
    router_pod = pod_spec(objects, "Deployment", "-router")
    epp_pod = pod_spec(objects, "Deployment", "-epp")
    return router_pod, container(router_pod, "router"), epp_pod, container(epp_pod, "epp")


@pytest.mark.parametrize("values", [GATEWAY_VALUES, VALUES_CASES["external-etcd"]])
def test_epp_runs_router_epp_with_the_router_settings_and_etcd_access(helm_bin: Path, tmp_path: Path,
                                                                      values: Path) -> None:
    objects = _render_overlay(helm_bin, tmp_path, {
        "gatewayApi": {"inferencePool": {"enabled": True}}, "colocation": {"enabled": True},
        "router": {"extraEnv": {"KVSHARD_ROUTER_ITEM_TOKENS": "24"}}}, base=values)
    router_pod, router, epp_pod, epp = _router_and_epp(objects)
    assert epp["args"] == ["router", "epp"] and router["args"] == ["router", "serve"]
    assert (epp["image"], epp["imagePullPolicy"]) == (router["image"], router["imagePullPolicy"])
    router_env = {e["name"]: e for e in router["env"]}
    epp_env = {e["name"]: e for e in epp["env"]}
    assert set(epp_env) - set(router_env) == {"KVSHARD_ROUTER_EPP_PORT"}
    assert {k: v for k, v in epp_env.items() if k != "KVSHARD_ROUTER_EPP_PORT"} == router_env
    assert epp_env["KVSHARD_ROUTER_ETCD_ENDPOINTS"]["value"], "etcd endpoints"
    assert epp_env["KVSHARD_ROUTER_CACHESHARD"]["value"] == "recommend/kvs-kvshard-movielens"
    assert epp_env["KVSHARD_ROUTER_COREQUEST_INTERVAL_SECONDS"]["value"] == "300", "co-requests count too"
    assert epp_env["KVSHARD_ROUTER_ITEM_TOKENS"]["value"] == "24", "router.extraEnv applies to the EPP"
    assert epp["volumeMounts"] == router["volumeMounts"] and epp_pod["volumes"] == router_pod["volumes"]


def test_epp_extra_env_wins_over_the_router_extra_env(helm_bin: Path, tmp_path: Path) -> None:
    objects = _render_overlay(helm_bin, tmp_path, {
        "router": {"extraEnv": {"KVSHARD_ROUTER_ITEM_TOKENS": "24"}},
        "gatewayApi": {"epp": {"extraEnv": {"KVSHARD_ROUTER_ITEM_TOKENS": "32"}}}})
    _, router, _, epp = _router_and_epp(objects)
    names = [e["name"] for e in epp["env"]]
    assert len(names) == len(set(names)), "each variable once"
    assert {e["name"]: e.get("value") for e in epp["env"]}["KVSHARD_ROUTER_ITEM_TOKENS"] == "32"
    assert {e["name"]: e.get("value") for e in router["env"]}["KVSHARD_ROUTER_ITEM_TOKENS"] == "24"


def test_epp_serves_health_and_metrics_on_the_router_port(helm_bin: Path) -> None:
    objects = render(helm_bin, GATEWAY_VALUES, sets=["router.port=8300"])
    _, _, _, epp = _router_and_epp(objects)
    assert _port(epp["ports"], "http")["containerPort"] == 8300
    assert {e["name"]: e.get("value") for e in epp["env"]}["KVSHARD_ROUTER_PORT"] == "8300"
    assert epp["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert epp["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert _port(find(objects, "Service", "-epp")["spec"]["ports"], "http")["port"] == 8300
    monitor = find(objects, "ServiceMonitor", "-epp")
    assert monitor["spec"]["endpoints"][0]["port"] == "http" and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True, "kvshard_router_*{pod} names the engine pod"
    assert monitor["spec"]["selector"]["matchLabels"] == find(objects, "Service", "-epp")["spec"]["selector"]


def test_epp_has_no_kubernetes_api_access(objects: list[Manifest]) -> None:
    epp_pod = pod_spec(objects, "Deployment", "-epp")
    account = find(objects, "ServiceAccount", "-epp")
    assert epp_pod["serviceAccountName"] == account["metadata"]["name"]
    assert epp_pod["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert account["metadata"]["name"] not in {s["name"] for s in binding["subjects"]}, kind_name(binding)


def test_epp_replicas_resources_and_disruption_budget_follow_the_values(helm_bin: Path) -> None:
    objects = render(helm_bin, GATEWAY_VALUES, sets=["gatewayApi.epp.replicas=3",
                                                     "gatewayApi.epp.resources.limits.memory=2Gi",
                                                     "gatewayApi.epp.podDisruptionBudget.maxUnavailable=2"])
    deployment = find(objects, "Deployment", "-epp")
    assert deployment["spec"]["replicas"] == 3
    assert container(deployment["spec"]["template"]["spec"], "epp")["resources"]["limits"]["memory"] == "2Gi"
    budget = find(objects, "PodDisruptionBudget", "-epp")
    assert budget["spec"]["maxUnavailable"] == 2
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    off = render(helm_bin, GATEWAY_VALUES, sets=["gatewayApi.epp.podDisruptionBudget.enabled=false",
                                                 "monitoring.serviceMonitor.enabled=false"])
    assert not [kind_name(o) for o in off if o["kind"] in ("PodDisruptionBudget", "ServiceMonitor")
                and o["metadata"]["name"].endswith("-epp")]


@pytest.mark.parametrize(("overlay", "message"), [
    ({"gatewayApi": {"epp": {"extraEnv": {"KVSHARD_ROUTER_EPP_PORT": "9003"}}}},
     "KVSHARD_ROUTER_EPP_PORT comes from gatewayApi.epp.port"),
    ({"router": {"enabled": False, "extraEnv": {"KVSHARD_ROUTER_COREQUEST_INTERVAL_SECONDS": "5"}}},
     "KVSHARD_ROUTER_COREQUEST_INTERVAL_SECONDS comes from colocation.enabled"),
    ({"gatewayApi": {"epp": {"port": 8200}}}, "gatewayApi.epp.port: 8200 is router.port too"),
])
def test_bad_endpoint_picker_settings_fail_the_render_naming_the_value(helm_bin: Path, tmp_path: Path,
                                                                       overlay: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmError, match=re.escape(message)):
        _render_overlay(helm_bin, tmp_path, overlay)


@pytest.mark.parametrize("setting", ["gatewayApi.epp.failureMode=Open", "gatewayApi.epp.port=0",
                                     "gatewayApi.gateway.namespace=Gateway_NS", "gatewayApi.epp.replicas=0"])
def test_values_schema_rejects_a_bad_gateway_value(helm_bin: Path, setting: str) -> None:
    with pytest.raises(HelmError, match="values don't meet the specifications of the schema"):
        render(helm_bin, GATEWAY_VALUES, sets=[setting])


def test_names_fit_63_characters_for_the_longest_release_name(helm_bin: Path) -> None:
    objects = render(helm_bin, GATEWAY_VALUES, release="r" * 53)
    pool = find(objects, "InferencePool")
    assert pool["spec"]["endpointPickerRef"]["name"] == find(objects, "Service", "-epp")["metadata"]["name"]
    for obj in objects:
        assert len(obj["metadata"]["name"]) <= 63, kind_name(obj)
    assert _violations(pool) == []


# ----------------------------------------------------------------------------------------------
# NetworkPolicies: the gateway's proxies reach the EPP's gRPC port and the sidecars; the EPP reaches
# what the router reaches.
# ----------------------------------------------------------------------------------------------
def _rule_ports(rule: dict[str, Any]) -> set[Any]:
    return {p["port"] for p in rule["ports"]}


def test_gateway_namespace_reaches_the_epp_grpc_port_and_the_sidecars(objects: list[Manifest]) -> None:
    gateway = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}}]
    epp = find(objects, "NetworkPolicy", "-epp")["spec"]
    assert epp["podSelector"]["matchLabels"] == find(objects, "Deployment", "-epp")["spec"]["selector"]["matchLabels"]
    assert [(r["from"], _rule_ports(r)) for r in epp["ingress"] if "grpc" in _rule_ports(r)] == [(gateway, {"grpc"})]
    engine = find(objects, "NetworkPolicy", "-engine")["spec"]
    assert (gateway, {"http"}) in [(r["from"], _rule_ports(r)) for r in engine["ingress"]]
    probes = next(r for r in engine["ingress"] if any("podSelector" in f for f in r["from"]))
    components = {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in probes["from"]}
    assert components == {"router", "engine", "epp"}
    etcd = find(objects, "NetworkPolicy", "-etcd")["spec"]["ingress"][0]
    assert "epp" in {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in etcd["from"]}


def test_epp_egress_is_the_router_egress(objects: list[Manifest]) -> None:
    epp = find(objects, "NetworkPolicy", "-epp")["spec"]
    router = find(objects, "NetworkPolicy", "-router")["spec"]
    assert epp["policyTypes"] == ["Ingress", "Egress"]
    assert epp["egress"] == router["egress"], "DNS, the engine pods' sidecar port, etcd"


def test_gateway_clients_value_replaces_the_gateway_namespace(helm_bin: Path, tmp_path: Path) -> None:
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "proxy"}}}]
    objects = _render_overlay(helm_bin, tmp_path, {"networkPolicy": {"gatewayClients": clients}})
    epp = find(objects, "NetworkPolicy", "-epp")["spec"]
    assert next(r for r in epp["ingress"] if "grpc" in _rule_ports(r))["from"] == clients
    engine = find(objects, "NetworkPolicy", "-engine")["spec"]
    assert (clients, {"http"}) in [(r["from"], _rule_ports(r)) for r in engine["ingress"]]
    gateway_namespace = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}}
    assert gateway_namespace not in [f for r in [*epp["ingress"], *engine["ingress"]] for f in r["from"]]


def test_without_network_policies_the_epp_gets_none_either(helm_bin: Path) -> None:
    objects = render(helm_bin, GATEWAY_VALUES, sets=["networkPolicy.enabled=false"])
    assert not [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert find(objects, "Deployment", "-epp") and find(objects, "InferencePool")


def test_gateway_namespace_defaults_to_the_release_namespace(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=[ON])
    epp = find(objects, "NetworkPolicy", "-epp")["spec"]
    grpc = next(r for r in epp["ingress"] if "grpc" in _rule_ports(r))
    assert grpc["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "recommend"}}}]


# ----------------------------------------------------------------------------------------------
# NOTES: the HTTPRoute to attach.
# ----------------------------------------------------------------------------------------------
def _notes(helm_bin: Path, *args: str) -> str:
    out = helm(helm_bin, "install", "kvs", str(CHART), "--namespace", "recommend", "--dry-run=client", *args)
    return out.split("NOTES:", 1)[1]


def _heredocs(notes: str) -> list[Manifest]:
    """The objects NOTES tell the user to ``kubectl apply -f - <<'EOF' … EOF``."""
    docs = re.findall(r"<<'EOF'\n(.*?)\n\s*EOF\n", notes, flags=re.S)
    return [yaml.safe_load(textwrap.dedent(d)) for d in docs]


def test_notes_wire_an_httproute_from_the_gateway_to_the_pool(helm_bin: Path) -> None:
    from kvshard_router.settings import RouterSettings

    notes = _notes(helm_bin, "-f", str(GATEWAY_VALUES))
    docs = {d["kind"]: d for d in _heredocs(notes) if d.get("apiVersion") == "gateway.networking.k8s.io/v1"}
    route = docs["HTTPRoute"]
    assert route["metadata"]["namespace"] == "recommend"
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway", "namespace": "gateway-system"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "kvs-kvshard-engine"}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/recommend"}}]
    timeout = int(rule["timeouts"]["request"].removesuffix("s"))
    assert timeout >= RouterSettings().request_timeout_seconds, "the gateway waits as long as the router would"
    gateway = docs["Gateway"]
    assert gateway["spec"]["gatewayClassName"] == "istio"
    assert (gateway["metadata"]["name"], gateway["metadata"]["namespace"]) == ("inference-gateway", "gateway-system")
    allowed = gateway["spec"]["listeners"][0]["allowedRoutes"]["namespaces"]
    assert allowed == {"from": "Selector", "selector": {"matchLabels": {"kubernetes.io/metadata.name": "recommend"}}}
    for command in ("releases/download/v1.6.0/manifests.yaml", "rollout status deployment/kvs-kvshard-epp",
                    "get inferencepool kvs-kvshard-engine", "get httproute kvs-kvshard",
                    "-n gateway-system get gateway inference-gateway", "curl -s http://$GATEWAY/v1/recommend"):
        assert command in notes, command


def test_notes_without_a_gateway_class_show_no_gateway_and_a_same_namespace_route(helm_bin: Path) -> None:
    notes = _notes(helm_bin, "--set", ON)
    (route,) = [d for d in _heredocs(notes) if d.get("apiVersion") == "gateway.networking.k8s.io/v1"]
    assert route["kind"] == "HTTPRoute"
    assert route["spec"]["parentRefs"][0]["namespace"] == "recommend"


def test_notes_without_the_option_say_nothing_of_gateways(helm_bin: Path) -> None:
    notes = _notes(helm_bin)
    assert "InferencePool" not in notes and "HTTPRoute" not in notes and "-epp" not in notes
