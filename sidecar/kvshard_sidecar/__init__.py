"""kvshard sidecar: the data plane that lives beside vLLM in every GPU pod.

It owns the KV block store (memory → disk → peers), the blend engine, the HTTP API and the vLLM
KV connector. It never imports the operator: the two meet only through etcd and the shared core.
"""
