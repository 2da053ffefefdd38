"""kvshard beside vLLM: the KV connector vLLM loads, the pod-local exchange, the client and the plans.

Only :mod:`kvshard_sidecar.vllm.connector` imports ``vllm`` (it runs inside vLLM's worker); the rest is
what the sidecar needs to start vLLM, ask it, and tell its connector which stored rows to load.
"""
