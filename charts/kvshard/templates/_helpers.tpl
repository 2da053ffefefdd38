{{/*
Names: every object is <fullname>-<component>, truncated to 63 characters (the DNS label limit).
*/}}
{{- define "kvshard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvshard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* <fullname>-<component>; call with (dict "ctx" $ "component" "engine"). */}}
{{- define "kvshard.componentName" -}}
{{- printf "%s-%s" (include "kvshard.fullname" .ctx | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvshard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "engine"). */}}
{{- define "kvshard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvshard.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All recommended labels of one component; call with (dict "ctx" $ "component" "engine"). */}}
{{- define "kvshard.labels" -}}
helm.sh/chart: {{ include "kvshard.chart" .ctx }}
{{ include "kvshard.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvshard
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* An image reference; call with (dict "ctx" $ "image" .Values.operator.image). */}}
{{- define "kvshard.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* The restricted Pod Security container securityContext; readOnlyRootFilesystem is always true. */}}
{{- define "kvshard.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The restricted Pod Security pod securityContext; call with the uid. */}}
{{- define "kvshard.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ . }}
runAsGroup: {{ . }}
fsGroup: {{ . }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* etcd client endpoints (host:port) as a list, bundled or external. */}}
{{- define "kvshard.etcdEndpoints" -}}
{{- if .Values.etcd.external.enabled }}
{{- toYaml .Values.etcd.external.endpoints }}
{{- else }}
- {{ printf "%s.%s.svc:%d" (include "kvshard.componentName" (dict "ctx" . "component" "etcd")) .Release.Namespace (int .Values.etcd.clientPort) }}
{{- end }}
{{- end }}

{{/*
The followed CacheShard's name: cacheShard.name, or the example CacheShard's <fullname>-movielens.
One name for the example, the router and the sidecars, so they can never follow different shards.
*/}}
{{- define "kvshard.cacheShardName" -}}
{{- default (include "kvshard.componentName" (dict "ctx" . "component" "movielens")) .Values.cacheShard.name }}
{{- end }}

{{/* The followed CacheShard as <release namespace>/<name> (KVSHARD_ROUTER_/KVSHARD_SIDECAR_CACHESHARD). */}}
{{- define "kvshard.cacheShard" -}}
{{- printf "%s/%s" .Release.Namespace (include "kvshard.cacheShardName" .) }}
{{- end }}

{{/*
etcd env of a kvshard component: endpoints, the followed CacheShard, the TLS files of the mounted
client Secret (kvshard.etcdClientVolume) and, for an external etcd with etcd.external.secretName,
username and password from that Secret (never in the pod spec).
Call with (dict "ctx" $ "prefix" "KVSHARD_ROUTER_"); renders list items at column 0.
*/}}
{{- define "kvshard.etcdEnv" -}}
{{- $v := .ctx.Values }}
- name: {{ .prefix }}ETCD_ENDPOINTS
  value: {{ include "kvshard.etcdEndpoints" .ctx | fromYamlArray | join "," | quote }}
- name: {{ .prefix }}CACHESHARD
  value: {{ include "kvshard.cacheShard" .ctx | quote }}
{{- if include "kvshard.etcdTLS" .ctx }}
- name: {{ .prefix }}ETCD_CA_FILE
  value: {{ include "kvshard.etcdClientDir" . }}/ca.crt
- name: {{ .prefix }}ETCD_CERT_FILE
  value: {{ include "kvshard.etcdClientDir" . }}/tls.crt
- name: {{ .prefix }}ETCD_KEY_FILE
  value: {{ include "kvshard.etcdClientDir" . }}/tls.key
{{- if $v.etcd.tls.serverName }}
- name: {{ .prefix }}ETCD_SERVER_NAME
  value: {{ $v.etcd.tls.serverName | quote }}
{{- end }}
{{- end }}
{{- if and $v.etcd.external.enabled $v.etcd.external.secretName }}
- name: {{ .prefix }}ETCD_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ $v.etcd.external.secretName }}
      key: username
- name: {{ .prefix }}ETCD_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $v.etcd.external.secretName }}
      key: password
{{- end }}
{{- end }}

{{/* Whether components talk TLS to etcd: always to the bundled one, to an external one with etcd.external.tls.enabled. */}}
{{- define "kvshard.etcdTLS" -}}
{{- if or (not .Values.etcd.external.enabled) .Values.etcd.external.tls.enabled }}true{{ end }}
{{- end }}

{{/* Where router and sidecars mount the etcd client Secret. */}}
{{- define "kvshard.etcdClientDir" -}}
/var/run/secrets/kvshard/etcd-client
{{- end }}

{{/*
The Secret with etcd's TLS material for one role: server, peer or client (etcd.tls.<role>Secret, else
<fullname>-etcd-<role>). Call with (dict "ctx" $ "role" "client").
*/}}
{{- define "kvshard.etcdSecretName" -}}
{{- default (include "kvshard.componentName" (dict "ctx" .ctx "component" (printf "etcd-%s" .role))) (get .ctx.Values.etcd.tls (printf "%sSecret" .role)) }}
{{- end }}

{{/*
Whether the chart asks cert-manager for the etcd certificate of a role: the server and peer ones for
the bundled etcd, the client one too, or for an external TLS etcd when certManager.issuerRef names an
issuer that etcd trusts. Call with (dict "ctx" $ "role" "client"); renders "true" or nothing.
*/}}
{{- define "kvshard.etcdCertificate" -}}
{{- $v := .ctx.Values }}
{{- if $v.certManager.enabled }}
{{- if not $v.etcd.external.enabled }}true
{{- else if and (eq .role "client") $v.etcd.external.tls.enabled $v.certManager.issuerRef.name }}true
{{- end }}
{{- end }}
{{- end }}

{{/* Whether the chart makes its own CA with cert-manager (no issuerRef.name, bundled etcd). */}}
{{- define "kvshard.etcdOwnCA" -}}
{{- if and .Values.certManager.enabled (not .Values.certManager.issuerRef.name) (not .Values.etcd.external.enabled) }}true{{ end }}
{{- end }}

{{/* The issuerRef of etcd's server, peer and client Certificates. */}}
{{- define "kvshard.etcdIssuerRef" -}}
{{- if .Values.certManager.issuerRef.name }}
{{- toYaml .Values.certManager.issuerRef }}
{{- else }}
name: {{ include "kvshard.componentName" (dict "ctx" . "component" "etcd-ca") }}
kind: Issuer
group: cert-manager.io
{{- end }}
{{- end }}

{{/* The etcd client Secret as a pod volume (list item at column 0), when components talk TLS to etcd. */}}
{{- define "kvshard.etcdClientVolume" -}}
{{- if include "kvshard.etcdTLS" . }}
- name: etcd-client-tls
  secret:
    secretName: {{ include "kvshard.etcdSecretName" (dict "ctx" . "role" "client") }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* Its mount (list item at column 0). */}}
{{- define "kvshard.etcdClientVolumeMount" -}}
{{- if include "kvshard.etcdTLS" . }}
- name: etcd-client-tls
  mountPath: {{ include "kvshard.etcdClientDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* NetworkPolicy egress rule to the cluster DNS (list item at column 0). */}}
{{- define "kvshard.dnsEgress" -}}
# DNS: etcd, Prometheus and pod names are resolved.
- to:
    - namespaceSelector:
        {{- toYaml .Values.networkPolicy.dns.namespaceSelector | nindent 8 }}
      podSelector:
        {{- toYaml .Values.networkPolicy.dns.podSelector | nindent 8 }}
  ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end }}

{{/*
NetworkPolicy egress rule to etcd's client port (list item at column 0): the bundled etcd's pods,
or the external endpoints' ports (to networkPolicy.externalEtcdPeers, else anywhere).
*/}}
{{- define "kvshard.etcdEgress" -}}
# etcd: placement generations and warm reports.
{{- if .Values.etcd.external.enabled }}
{{- $ports := dict }}
{{- range .Values.etcd.external.endpoints }}
{{- $_ := set $ports (regexReplaceAll "^.*:" . "") true }}
{{- end }}
- ports:
    {{- range $port, $_ := $ports }}
    - port: {{ int $port }}
      protocol: TCP
    {{- end }}
  {{- with .Values.networkPolicy.externalEtcdPeers }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- else }}
- to:
    - podSelector:
        matchLabels:
          {{- include "kvshard.selectorLabels" (dict "ctx" . "component" "etcd") | nindent 10 }}
  ports:
    - port: {{ .Values.etcd.clientPort }}
      protocol: TCP
{{- end }}
{{- end }}

{{/* The Secret holding the sidecars' shared peer token. */}}
{{- define "kvshard.peerTokenSecretName" -}}
{{- default (include "kvshard.componentName" (dict "ctx" . "component" "peer-token")) .Values.engine.peerToken.existingSecret }}
{{- end }}

{{/* Whether the engine StatefulSet is scaled by an autoscaler (then it sets no replicas). */}}
{{- define "kvshard.engineAutoscaled" -}}
{{- if .Values.autoscaling.enabled }}true{{ end }}
{{- end }}

{{/* Most engine pods that can exist, for the static peer list. */}}
{{- define "kvshard.engineMaxReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ .Values.autoscaling.maxReplicas }}{{ else }}{{ .Values.engine.replicas }}{{ end }}
{{- end }}

{{/*
Fails the render on an engine.vllm.extraArgs item that turns vLLM's prefix caching back on after the
chart's --no-enable-prefix-caching (the last flag wins): --enable-prefix-caching in any spelling vLLM
accepts — underscores, "=value", or an unambiguous abbreviation such as --enable-prefix.
Call with one extraArgs item; renders nothing.
*/}}
{{- define "kvshard.checkVllmExtraArg" -}}
{{- $flag := regexReplaceAll "=.*$" (toString .) "" | replace "_" "-" }}
{{- if and (hasPrefix "--enable-pre" $flag) (hasPrefix $flag "--enable-prefix-caching") }}
{{- fail (printf "engine.vllm.extraArgs: %q would turn vLLM's prefix caching back on. The chart runs vLLM with --no-enable-prefix-caching because vLLM would otherwise cache the blocks the kvshard connector fills from blended (approximate) KV and reuse them as exact prefix hits for later requests sharing the prompt's tokens; the connector refuses to start beside it. Remove the flag (the sidecar already reuses the exact system and history prefixes)." .) }}
{{- end }}
{{- end }}

{{/* The vLLM --kv-transfer-config JSON that loads the kvshard connector. */}}
{{- define "kvshard.kvTransferConfig" -}}
{{- if include "kvshard.vllmComputes" . }}
{{- dict "kv_connector" "KvshardConnector" "kv_connector_module_path" "kvshard_sidecar.vllm.connector" "kv_role" "kv_both" "kv_load_failure_policy" "fail" "kv_connector_extra_config" (dict "exchange_dir" .Values.engine.exchangeDir "block_dir" "/var/cache/kvshard/blocks" "block_bytes" (int64 .Values.engine.sidecar.diskBytes)) | toJson }}
{{- else }}
{{- dict "kv_connector" "KvshardConnector" "kv_connector_module_path" "kvshard_sidecar.vllm.connector" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" (dict "exchange_dir" .Values.engine.exchangeDir) | toJson }}
{{- end }}
{{- end }}

{{/*
Non-empty when vLLM does all the math (a block-trained scorer, engine.model.scorer late or isolated):
prefix cache on, item blocks read from the pod's disk tier, a failed block load fails the request
(the sidecar warms the block again) instead of computing an item body causally.
*/}}
{{- define "kvshard.vllmComputes" -}}
{{- if has .Values.engine.model.scorer (list "late" "isolated") }}true{{ end }}
{{- end }}

{{/*
The operator's rules on namespaced resources, each verb for a reason (see the comments); used by
the ClusterRole (every namespace) or by one Role per watched namespace.
*/}}
{{- define "kvshard.operatorNamespacedRules" -}}
# CacheShards: kopf lists and watches them (create/update/resume/delete handlers and timers);
# patch adds the finalizer and kopf's progress and last-handled-spec annotations.
- apiGroups: [kvshard.io]
  resources: [cacheshards]
  verbs: [list, watch, patch]
# Status conditions, placement generation and counts go through the status subresource.
- apiGroups: [kvshard.io]
  resources: [cacheshards/status]
  verbs: [patch]
# The pod index: ready engine pods selected by spec.podSelector (placement follows scaling).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# spec.catalog.configMap: the item catalog is read by name once per spec.catalog.refreshSeconds.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get]
# spec.etcd.secretRef (etcd username and password) and spec.etcd.tls.secretRef (etcd's CA and the
# client certificate): list and watch feed the operator's Secret index, so its timers read them from
# memory instead of calling the API on every tick, and a renewed certificate arrives with the watch.
# The index keeps only Secrets holding `ca.crt` or `username`; list/watch adds no reach beyond `get`,
# which already reads any Secret of these namespaces by name (scope them with watchNamespaces).
# get: spec.catalog.url.secretRef (the catalog URL's bearer token), and an etcd Secret the watch has
# not delivered yet.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, watch]
# kopf posts handler warnings and errors as Events on the CacheShard.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.operator.embedding.enabled }}
# Embedding Jobs (operator.embedding): create starts the Indexed Job of a catalog's missing chunks
# (and a new attempt, under a new name, after one gave up); get reads its progress (active, failed,
# succeeded pods, the Failed condition) by name for status.embedding. No list or watch (the
# operator knows each Job's name), no delete (ttlSecondsAfterFinished removes finished Jobs), no
# rights on the Job's pods: the Job controller creates and retries them.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [create, get]
{{- end }}
{{- end }}

{{/*
The PromQL the engine autoscaler scales on: every engine pod's pressure averaged over the window,
summed. Keep in step with kvshard.autoscaling.pressure_query (tests/chart checks they are equal).
*/}}
{{- define "kvshard.pressureQuery" -}}
{{- $sts := include "kvshard.componentName" (dict "ctx" . "component" "engine") -}}
{{- printf "sum(avg_over_time(kvshard_sidecar_pressure{namespace=%q,pod=~\"%s-[0-9]+\"}[%s]))" .Release.Namespace $sts .Values.autoscaling.pressureWindow -}}
{{- end }}

{{/*
The HPA behavior of the engine autoscaler (the HPA's own, KEDA's generated one, the local loop's).
*/}}
{{- define "kvshard.autoscalingBehavior" -}}
{{- $b := .Values.autoscaling.behavior -}}
scaleUp:
  stabilizationWindowSeconds: {{ $b.scaleUp.stabilizationWindowSeconds }}
  policies:
    - type: Pods
      value: {{ $b.scaleUp.pods }}
      periodSeconds: {{ $b.scaleUp.periodSeconds }}
scaleDown:
  stabilizationWindowSeconds: {{ $b.scaleDown.stabilizationWindowSeconds }}
  policies:
    - type: Pods
      value: {{ $b.scaleDown.pods }}
      periodSeconds: {{ $b.scaleDown.periodSeconds }}
{{- end }}

{{/*
The engine containers' preStop command: ask the sidecar on loopback to drain and wait for it.
Python is in both images (no curl needed); a failure (sidecar already gone) must not block exit.
*/}}
{{- define "kvshard.drainCommand" -}}
{{- $e := .Values.engine -}}
{{- $url := printf "http://127.0.0.1:%d/v1/drain?timeout=%d" (int $e.sidecar.port) (int $e.sidecar.drainTimeoutSeconds) -}}
{{- $script := printf "import urllib.request\ntry:\n    urllib.request.urlopen(%q, timeout=%d)\nexcept Exception as e:\n    print('drain:', e)" $url (add (int $e.sidecar.drainTimeoutSeconds) 5) -}}
{{- list "python3" "-c" $script | toJson -}}
{{- end }}

{{/*
etcd's backend quota (--quota-backend-bytes) from the catalog size (etcd.sizing), in bytes:
  live    = items × (mapBytesPerItem × mapsKept + catalogBytesPerItem × catalogVersionsKept)
  quota   = max(2 GiB, ceil_GiB(live × historyFactor + fixedBytes))
mapBytesPerItem: ~14 B per item→cluster entry of a generation's map (measured: 12.2 MiB per 1 M items);
mapsKept: 2 generations kept + 1 being published; catalogBytesPerItem: ~80 B per item of a published
catalog version (kvshard/catalog_schema.py: ~80 MB per 1 M items of ~60-character texts), 2 versions
kept; historyFactor: old revisions etcd keeps until auto-compaction (etcd.compaction) and until
defragmentation returns their pages; fixedBytes: assignments, warm, heat, co-request and blend keys.
Above etcd's recommended maximum of 8 GiB the chart refuses to render (use an external etcd sized for it).
*/}}
{{- define "kvshard.etcdQuotaBytes" -}}
{{- $s := .Values.etcd.sizing -}}
{{- $gib := 1073741824 -}}
{{- $perItem := add (mul (int64 $s.mapBytesPerItem) (int64 $s.mapsKept)) (mul (int64 $s.catalogBytesPerItem) (int64 $s.catalogVersionsKept)) -}}
{{- $live := mul (int64 $s.catalogItems) $perItem -}}
{{- $total := add (mul $live (int64 $s.historyFactor)) (int64 $s.fixedBytes) -}}
{{- $rounded := mul (div (add $total (sub $gib 1)) $gib) $gib -}}
{{- $quota := max (mul 2 $gib) $rounded -}}
{{- if gt (int64 $quota) (mul 8 $gib) -}}
{{- fail (printf "etcd.sizing: %d catalog items need an etcd quota of %d bytes (%d GiB), above etcd's recommended maximum of 8 GiB; use etcd.external with an etcd sized for it, or lower etcd.sizing.historyFactor / etcd.compaction.retention" (int64 $s.catalogItems) (int64 $quota) (div $quota $gib)) -}}
{{- end -}}
{{- $quota -}}
{{- end }}

{{/* The Gateway's namespace (gatewayApi.gateway.namespace, else the release namespace). */}}
{{- define "kvshard.gatewayNamespace" -}}
{{- default .Release.Namespace .Values.gatewayApi.gateway.namespace }}
{{- end }}

{{/*
NetworkPolicy `from` entries of the inference gateway's proxies (list items at column 0):
networkPolicy.gatewayClients, else every pod in the Gateway's namespace.
*/}}
{{- define "kvshard.gatewayClients" -}}
{{- if .Values.networkPolicy.gatewayClients }}
{{- toYaml .Values.networkPolicy.gatewayClients }}
{{- else }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ include "kvshard.gatewayNamespace" . }}
{{- end }}
{{- end }}
