"""kvshard sidecar: the data plane that lives beside vLLM in every GPU pod.

Its rooms: :mod:`~kvshard_sidecar.api` (HTTP, validation, metrics, drain), :mod:`~kvshard_sidecar.serving`
(the request path), :mod:`~kvshard_sidecar.follow` (placement, catalog and blend settings from etcd),
:mod:`~kvshard_sidecar.engine` (the blend engine and the models it runs), :mod:`~kvshard_sidecar.blockstore`
(memory → disk → peers) and :mod:`~kvshard_sidecar.vllm` (the connector, exchange and client). It never
imports the operator: the two meet only through etcd and the shared core.
"""
