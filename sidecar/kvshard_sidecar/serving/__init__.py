"""The request path of one sidecar: prompt → blocks → the embedded engine or vLLM → answer.

:class:`~kvshard_sidecar.serving.service.SidecarService` composes a few collaborators, each with one
job; none of them knows HTTP (that is :mod:`kvshard_sidecar.api`) or etcd (that is
:mod:`kvshard_sidecar.follow`). The prefill queue that warms blocks between requests lives here too:
the followers fill it, the service drains it.
"""
