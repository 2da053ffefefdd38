"""Security wiring of the rendered chart: etcd serves only TLS with client-certificate auth, from
Secrets cert-manager fills (or the user provides); every component connects with the client Secret;
and a NetworkPolicy selects every component, admitting exactly the traffic kvshard needs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from chart_helpers import (
    VALUES_CASES,
    Manifest,
    container,
    engine_pod,
    find,
    kind_name,
    pod_spec,
    pod_specs,
    render,
    resolved_env,
)

CLIENT_DIR = "/var/run/secrets/kvshard/etcd-client"
ENGINE_POD = {"metadata.name": "kvs-kvshard-engine-0", "status.podIP": "10.244.1.7"}
ETCD_AUTH = {("kvshard-etcd-auth", "username"): "kvshard", ("kvshard-etcd-auth", "password"): "s3cret"}


def _flags(objects: list[Manifest]) -> dict[str, str]:
    """``--flag=value`` of the bundled etcd's command."""
    command = container(pod_spec(objects, "StatefulSet", "-etcd"), "etcd")["command"]
    return dict(arg.removeprefix("--").split("=", 1) for arg in command[1:])


def _secret_volumes(spec: Mapping[str, Any]) -> dict[str, str]:
    """Mount path → Secret name, for the Secret volumes of a pod spec's containers."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
    return {m["mountPath"]: secrets[m["name"]] for c in spec["containers"] for m in c.get("volumeMounts", [])
            if m["name"] in secrets}


def _settings(objects: list[Manifest], component: str) -> Any:
    from kvshard import settings as settings_lib

    if component == "router":
        from kvshard_router.settings import ENV_PREFIX, RouterSettings

        spec = container(pod_spec(objects, "Deployment", "-router"), "router")
        environ = resolved_env(spec, field_refs={}, secrets=ETCD_AUTH)
        return settings_lib.from_sources(RouterSettings, None, ENV_PREFIX, environ)
    from kvshard_sidecar.settings import ENV_PREFIX as SIDECAR_PREFIX
    from kvshard_sidecar.settings import SidecarSettings

    environ = resolved_env(container(engine_pod(objects), "sidecar"), field_refs=ENGINE_POD, secrets=ETCD_AUTH)
    return settings_lib.from_sources(SidecarSettings, None, SIDECAR_PREFIX, environ)


# ----------------------------------------------------------------------------------------------
# etcd over TLS
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["default", "monitoring-off", "kind"])
def test_the_bundled_etcd_serves_only_tls_and_demands_client_and_peer_certificates(
        rendered: dict[str, list[Manifest]], case: str) -> None:
    objects = rendered[case]
    flags = _flags(objects)
    for url in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
        assert flags[url].startswith("https://"), (url, flags[url])
    assert all(member.split("=", 1)[1].startswith("https://") for member in flags["initial-cluster"].split(","))
    assert (flags["client-cert-auth"], flags["peer-client-cert-auth"]) == ("true", "true")
    assert (flags["auto-tls"], flags["peer-auto-tls"]) == ("false", "false")
    # only /health and /metrics are plain HTTP, on their own port, and the probe uses it
    assert flags["listen-metrics-urls"] == "http://0.0.0.0:2381"
    etcd = container(pod_spec(objects, "StatefulSet", "-etcd"), "etcd")
    assert etcd["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {p["name"]: p["containerPort"] for p in etcd["ports"]} == {"client": 2379, "peer": 2380, "metrics": 2381}
    # the files come from the server and peer Secrets, mounted read-only
    mounts = _secret_volumes(pod_spec(objects, "StatefulSet", "-etcd"))
    assert mounts == {"/etc/etcd/tls/server": "kvs-kvshard-etcd-server", "/etc/etcd/tls/peer": "kvs-kvshard-etcd-peer"}
    for flag, path in (("cert-file", "server/tls.crt"), ("key-file", "server/tls.key"),
                       ("trusted-ca-file", "server/ca.crt"), ("peer-cert-file", "peer/tls.crt"),
                       ("peer-key-file", "peer/tls.key"), ("peer-trusted-ca-file", "peer/ca.crt")):
        assert flags[flag] == f"/etc/etcd/tls/{path}", flag


def test_cert_manager_certificates_fill_the_secrets_etcd_mounts_and_name_what_clients_dial(
        rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["default"]
    ca = find(objects, "Certificate", "-etcd-ca")
    assert ca["spec"]["isCA"] is True and ca["spec"]["issuerRef"]["name"] == "kvs-kvshard-etcd-selfsigned"
    assert find(objects, "Issuer", "-etcd-ca")["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
    server, peer, client = (find(objects, "Certificate", f"-etcd-{r}")["spec"] for r in ("server", "peer", "client"))
    for spec in (server, peer, client):
        assert spec["issuerRef"] == {"name": "kvs-kvshard-etcd-ca", "kind": "Issuer", "group": "cert-manager.io"}
        assert spec["privateKey"]["rotationPolicy"] == "Always"
    assert (server["secretName"], peer["secretName"], client["secretName"]) == (
        "kvs-kvshard-etcd-server", "kvs-kvshard-etcd-peer", "kvs-kvshard-etcd-client")
    assert "server auth" in server["usages"] and {"server auth", "client auth"} <= set(peer["usages"])
    assert client["usages"] == ["digital signature", "key encipherment", "client auth"]
    # what the components dial (the Service) and what members advertise are names the certificates carry
    endpoint_host = _settings(objects, "router").etcd_endpoints[0].rsplit(":", 1)[0]
    assert endpoint_host in server["dnsNames"]
    flags = _flags(objects)
    member_host = flags["initial-advertise-peer-urls"].split("//")[1].rsplit(":", 1)[0]  # $(POD_NAME).<headless>…
    wildcard = "*." + member_host.split(".", 1)[1]
    assert wildcard in server["dnsNames"] and wildcard in peer["dnsNames"]


def test_every_component_connects_with_the_client_secret(rendered: dict[str, list[Manifest]]) -> None:
    for case in ("default", "autoscaling", "kind", "external-etcd"):
        objects = rendered[case]
        secret = "kvshard-etcd-client" if case == "external-etcd" else "kvs-kvshard-etcd-client"
        for component, spec in (("router", pod_spec(objects, "Deployment", "-router")),
                                ("sidecar", engine_pod(objects))):
            assert _secret_volumes(spec)[CLIENT_DIR] == secret, (case, component)
            settings = _settings(objects, component)
            assert (settings.etcd_ca_file, settings.etcd_cert_file, settings.etcd_key_file) == (
                Path(CLIENT_DIR, "ca.crt"), Path(CLIENT_DIR, "tls.crt"), Path(CLIENT_DIR, "tls.key")), case
            assert settings.etcd_server_name == ("etcd.infra.svc" if case == "external-etcd" else ""), case
        # the operator reads the same Secret through the CacheShard (its RBAC may get Secrets)
        if case in ("autoscaling", "external-etcd"):
            tls = find(objects, "CacheShard")["spec"]["etcd"]["tls"]
            assert tls["secretRef"] == {"name": secret}, case
    # an external etcd names no cert-manager objects: the client Secret is the user's
    assert not [kind_name(o) for o in rendered["external-etcd"] if o["apiVersion"].startswith("cert-manager.io/")]


def test_an_external_etcd_without_tls_gets_plaintext_settings(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=["etcd.external.enabled=true", "etcd.external.endpoints={etcd.infra:2379}",
                                     "exampleCacheShard.enabled=true"])
    for component in ("router", "sidecar"):
        settings = _settings(objects, component)
        assert (settings.etcd_ca_file, settings.etcd_cert_file, settings.etcd_key_file) == (None, None, None)
    assert CLIENT_DIR not in _secret_volumes(engine_pod(objects))
    assert "tls" not in find(objects, "CacheShard")["spec"]["etcd"]


def test_without_cert_manager_etcd_mounts_the_secrets_the_user_names(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=["certManager.enabled=false", "etcd.tls.serverSecret=my-etcd-server",
                                     "etcd.tls.peerSecret=my-etcd-peer", "etcd.tls.clientSecret=my-etcd-client",
                                     "exampleCacheShard.enabled=true"])
    assert not [kind_name(o) for o in objects if o["apiVersion"].startswith("cert-manager.io/")]
    assert _secret_volumes(pod_spec(objects, "StatefulSet", "-etcd")) == {
        "/etc/etcd/tls/server": "my-etcd-server", "/etc/etcd/tls/peer": "my-etcd-peer"}
    assert _secret_volumes(engine_pod(objects))[CLIENT_DIR] == "my-etcd-client"
    assert find(objects, "CacheShard")["spec"]["etcd"]["tls"] == {"secretRef": {"name": "my-etcd-client"}}


def test_an_issuer_of_your_own_replaces_the_charts_ca(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=["certManager.issuerRef.name=corp-ca", "certManager.issuerRef.kind=ClusterIssuer"])
    kinds = sorted(kind_name(o) for o in objects if o["apiVersion"].startswith("cert-manager.io/"))
    assert kinds == ["Certificate/kvs-kvshard-etcd-client", "Certificate/kvs-kvshard-etcd-peer",
                     "Certificate/kvs-kvshard-etcd-server"]
    for obj in objects:
        if obj["kind"] == "Certificate":
            assert obj["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    external = render(helm_bin, sets=["etcd.external.enabled=true", "etcd.external.endpoints={etcd.infra:2379}",
                                      "etcd.external.tls.enabled=true", "certManager.issuerRef.name=corp-ca"])
    assert [kind_name(o) for o in external if o["apiVersion"].startswith("cert-manager.io/")] == [
        "Certificate/kvs-kvshard-etcd-client"], "an external etcd trusting corp-ca gets a client certificate only"


# ----------------------------------------------------------------------------------------------
# NetworkPolicies
# ----------------------------------------------------------------------------------------------

def _labels(objects: list[Manifest], where: str) -> dict[str, str]:
    workload = next(o for o in objects if kind_name(o) == where)
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def _matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    from kvshard_operator import selectors

    return selectors.matches(dict(selector), dict(labels))


def _ports(objects: list[Manifest], labels: Mapping[str, str]) -> dict[str, int]:
    """Named container ports of the workload whose pods carry ``labels``."""
    for where, spec in pod_specs(objects):
        if _labels(objects, where) == labels:
            return {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
    return {}


def _port_ok(rule: Mapping[str, Any], port: int, named: Mapping[str, int]) -> bool:
    return "ports" not in rule or any(named.get(p["port"], p["port"]) == port for p in rule["ports"])


def _peer_ok(peers: list[Mapping[str, Any]] | None, labels: Mapping[str, str] | None) -> bool:
    """Whether a same-namespace pod with ``labels`` (None: an address outside the cluster) is one of ``peers``."""
    if peers is None:
        return True  # no from/to: everyone
    for peer in peers:
        if labels is not None and set(peer) == {"podSelector"} and _matches(peer["podSelector"], labels):
            return True
        if labels is None and "ipBlock" in peer:
            return True
    return False


def _policies(objects: list[Manifest], labels: Mapping[str, str]) -> list[Manifest]:
    return [o for o in objects if o["kind"] == "NetworkPolicy" and _matches(o["spec"]["podSelector"], labels)]


def allowed(objects: list[Manifest], source: str, target: str, port: int) -> bool:
    """Whether NetworkPolicies let pods of workload ``source`` open ``port`` on pods of ``target``: the
    source's egress and the target's ingress both admit it (no policy of a type: admitted)."""
    src, dst = _labels(objects, source), _labels(objects, target)
    named = _ports(objects, dst)

    def admits(policies: list[Manifest], kind: str, peer: Mapping[str, str]) -> bool:
        typed = [p for p in policies if kind in p["spec"]["policyTypes"]]
        key, side = ("egress", "to") if kind == "Egress" else ("ingress", "from")
        return not typed or any(_peer_ok(rule.get(side), peer) and _port_ok(rule, port, named)
                                for p in typed for rule in p["spec"].get(key, []))

    return admits(_policies(objects, src), "Egress", dst) and admits(_policies(objects, dst), "Ingress", src)


OPERATOR, ROUTER = "Deployment/kvs-kvshard-operator", "Deployment/kvs-kvshard-router"
ENGINE, ETCD = "StatefulSet/kvs-kvshard-engine", "StatefulSet/kvs-kvshard-etcd"


@pytest.mark.parametrize("case", [c for c in VALUES_CASES if c != "monitoring-off"])
def test_a_network_policy_selects_every_component(rendered: dict[str, list[Manifest]], case: str) -> None:
    objects = rendered[case]
    for where, _ in pod_specs(objects):
        policies = _policies(objects, _labels(objects, where))
        assert policies, f"{case}: no NetworkPolicy selects the pods of {where}"
    for where in (OPERATOR, ROUTER):
        (policy,) = _policies(objects, _labels(objects, where))
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"], (case, where)


def test_monitoring_off_values_turn_every_network_policy_off(rendered: dict[str, list[Manifest]]) -> None:
    assert not [o for o in rendered["monitoring-off"] if o["kind"] == "NetworkPolicy"]


def test_network_policies_admit_exactly_the_traffic_kvshard_needs(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["default"]
    needed = [(ROUTER, ENGINE, 8100), (ENGINE, ENGINE, 8100), (ROUTER, ETCD, 2379), (OPERATOR, ETCD, 2379),
              (ENGINE, ETCD, 2379), (ETCD, ETCD, 2380)]
    for source, target, port in needed:
        assert allowed(objects, source, target, port), (source, target, port)
    refused = [(OPERATOR, ENGINE, 8100), (ROUTER, OPERATOR, 9090), (ENGINE, OPERATOR, 9090), (ROUTER, ETCD, 2380),
               (ENGINE, ETCD, 2380), (ROUTER, ENGINE, 8000), (OPERATOR, ROUTER, 8200)]
    for source, target, port in refused:
        assert not allowed(objects, source, target, port), (source, target, port)


def test_the_operator_talks_only_to_dns_the_api_server_etcd_and_prometheus(rendered: dict[str, list[Manifest]]) -> None:
    policy = find(rendered["default"], "NetworkPolicy", "-operator")
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert ingress["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    dns, api, etcd, prometheus = policy["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53} and dns["to"][0]["podSelector"]["matchLabels"] == {
        "k8s-app": "kube-dns"}
    assert [p["port"] for p in api["ports"]] == [443, 6443] and "to" not in api  # by address, anywhere
    assert etcd["ports"] == [{"port": 2379, "protocol": "TCP"}]
    assert etcd["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "etcd"
    assert prometheus["ports"] == [{"port": 9090, "protocol": "TCP"}] and "namespaceSelector" in prometheus["to"][0]


def test_values_widen_or_narrow_the_policies(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=[
        "networkPolicy.apiServer.cidrs={10.0.0.1/32}",
        "networkPolicy.routerClients[0].namespaceSelector.matchLabels.team=shop",
        "networkPolicy.operatorExtraEgress[0].ports[0].port=443",
        "networkPolicy.routerExtraEgress[0].ports[0].port=4318",
    ])
    operator = find(objects, "NetworkPolicy", "-operator")["spec"]
    assert operator["egress"][1]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert operator["egress"][-1] == {"ports": [{"port": 443}]}
    router = find(objects, "NetworkPolicy", "-router")["spec"]
    clients, metrics = router["ingress"]
    assert clients["from"] == [{"namespaceSelector": {"matchLabels": {"team": "shop"}}}]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert router["egress"][-1] == {"ports": [{"port": 4318}]}


def test_an_external_etcd_is_reached_on_its_endpoints_ports_at_the_peers_given(
        rendered: dict[str, list[Manifest]]) -> None:
    for name in ("-operator", "-router"):
        rule = find(rendered["external-etcd"], "NetworkPolicy", name)["spec"]["egress"][-1 if name == "-router" else 2]
        assert rule == {"ports": [{"port": 2379, "protocol": "TCP"}], "to": [{"ipBlock": {"cidr": "10.96.20.0/24"}}]}


def test_etcd_metrics_are_open_to_prometheus_only(rendered: dict[str, list[Manifest]]) -> None:
    policy = find(rendered["default"], "NetworkPolicy", "-etcd")
    metrics = [r for r in policy["spec"]["ingress"] if any(p["port"] == "metrics" for p in r["ports"])]
    assert metrics == [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                        "ports": [{"port": "metrics", "protocol": "TCP"}]}]


def _notes(helm_bin: Path, *sets: str) -> str:
    from chart_helpers import CHART, helm

    args = [arg for s in sets for arg in ("--set", s)]
    out = helm(helm_bin, "install", "kvs", str(CHART), "--namespace", "recommend", "--dry-run=client", *args)
    return out.split("NOTES:", 1)[1]


def test_notes_name_the_client_secret_and_who_makes_the_certificates(helm_bin: Path) -> None:
    notes = _notes(helm_bin)
    assert "spec.etcd.tls.secretRef.name: kvs-kvshard-etcd-client" in notes
    assert "kubectl -n recommend get certificates" in notes
    by_hand = _notes(helm_bin, "certManager.enabled=false")
    assert "create secret generic kvs-kvshard-etcd-client" in by_hand
    assert "kvs-kvshard-etcd-server" in by_hand and "kvs-kvshard-etcd-peer" in by_hand
    plain = _notes(helm_bin, "etcd.external.enabled=true", "etcd.external.endpoints={etcd.infra:2379}")
    assert "spec.etcd.tls" not in plain
