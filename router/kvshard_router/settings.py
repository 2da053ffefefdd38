"""The router's one settings object: flags, then ``KVSHARD_ROUTER_*`` env, then defaults.

The router is stateless: everything it routes by comes from etcd (placement generations and the
sidecars' warm reports), so its settings are only where to listen, where etcd is, which CacheShard
to follow and how to score. The etcd password is a secret and comes from the environment only; the
etcd TLS files (CA, client certificate and key: a mounted Secret) are paths, read at startup.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvshard import settings as settings_lib
from kvshard.etcd_tls import EtcdTLS, files_problem
from kvshard.settings import setting

ENV_PREFIX = "KVSHARD_ROUTER_"
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_SHARD = re.compile(rf"(?P<namespace>{_DNS_LABEL})/(?P<name>{_DNS_LABEL}(\.{_DNS_LABEL})*)")
_HOST_PORT = re.compile(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")
PolicyName = Literal["affinity", "round-robin", "least-loaded", "prefix-aware"]


@dataclass(frozen=True)
class RouterSettings:
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 in a pod)")
    port: int = setting(8200, "HTTP port of the router (`router epp`: /healthz, /readyz, /metrics only)")
    epp_port: int = setting(9002, "gRPC port of the Gateway API Inference Extension endpoint picker (Envoy "
                            "ext_proc; `kvshard router epp` only)")
    etcd_endpoints: tuple[str, ...] = setting((), "etcd endpoints host:port holding the placement (comma-separated)")
    etcd_username: str = setting("", "etcd user (empty: no authentication)")
    etcd_password: str = setting("", "etcd password", secret=True)
    etcd_ca_file: Path | None = setting(None, "CA certificate (PEM) that signed etcd's server certificate; "
                                        "set, the router talks TLS to etcd (the Secret's ca.crt)")
    etcd_cert_file: Path | None = setting(None, "client certificate (PEM) the router presents to etcd "
                                          "(client-cert auth; tls.crt); needs the key and the CA file")
    etcd_key_file: Path | None = setting(None, "private key (PEM) of the etcd client certificate (tls.key)")
    etcd_server_name: str = setting("", "name etcd's server certificate must carry (empty: the host of the "
                                    "first endpoint)")
    cacheshard: str = setting("", "the CacheShard whose placement to follow, as <namespace>/<name>")
    policy: PolicyName = setting("affinity", "routing policy: affinity (cached tokens minus load), round-robin, "
                                 "least-loaded or prefix-aware (the baselines)")
    cached_token_cost: float = setting(0.2, "cost of a cached (blended) block token relative to a prefilled one "
                                       "(blending recomputes ~15 % and loads the rest) in each request's work estimate")
    request_overhead_tokens: float = setting(128.0, "token equivalents of a request beyond its blocks (system and "
                                             "question tokens, decoding the answer) in its work estimate")
    recent_blocks_per_pod: int = setting(
        256, "item blocks per pod the affinity router remembers sending outside the placement and counts as "
        "cached there (the pod computed and kept them); keep it at or below what a pod's memory tier holds "
        "beyond its placement: counting evicted blocks costs more locality than forgetting kept ones (0: off)")
    health_interval_seconds: float = setting(1.0, "seconds between GET <pod>/readyz probes of every known pod")
    request_timeout_seconds: float = setting(120.0, "longest a forwarded /v1/recommend may take (then 504)")
    connect_timeout_seconds: float = setting(2.0, "longest a connection to a pod (then the next pod) or a "
                                             "/readyz probe may take")
    item_tokens: int = setting(16, "tokens assumed per item block when scoring pods")
    history_tokens: int = setting(0, "tokens credited for the user-history block (replicated on every pod)")
    corequest_interval_seconds: float = setting(
        30.0, "seconds between publishes of the co-requested cluster pairs to etcd (0: not counted)")
    corequest_top_pairs: int = setting(1024, "co-requested cluster pairs (and clusters) published per interval")
    router_name: str = setting("", "this router's name under corequest/ in etcd (empty: the host name)")

    def __post_init__(self) -> None:
        for name in ("port", "epp_port"):
            if not 1 <= getattr(self, name) <= 65535:
                raise settings_lib.SettingsError(f"{name} must be in 1..65535")
        if not 0.0 <= self.cached_token_cost <= 1.0:
            raise settings_lib.SettingsError("cached_token_cost must be in [0, 1]")
        for name in ("health_interval_seconds", "request_timeout_seconds", "connect_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise settings_lib.SettingsError(f"{name} must be > 0")
        for name in ("request_overhead_tokens", "recent_blocks_per_pod", "item_tokens", "history_tokens",
                     "corequest_interval_seconds"):
            if getattr(self, name) < 0:
                raise settings_lib.SettingsError(f"{name} must be >= 0")
        if self.corequest_top_pairs < 1:
            raise settings_lib.SettingsError("corequest_top_pairs must be >= 1")
        bad = [e for e in self.etcd_endpoints if not _HOST_PORT.fullmatch(e)]
        if bad:
            raise settings_lib.SettingsError(f"etcd_endpoints: {', '.join(bad)} is not host:port")
        problem = files_problem(self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file)
        if problem:
            raise settings_lib.SettingsError(f"{ENV_PREFIX}ETCD_CA_FILE/_CERT_FILE/_KEY_FILE: {problem}")
        if self.cacheshard:
            self.shard()  # validates the form
        elif self.etcd_endpoints:
            raise settings_lib.SettingsError("cacheshard (<namespace>/<name>) is required with etcd_endpoints")

    def etcd_tls(self) -> EtcdTLS | None:
        """The etcd TLS material read from its files (``None``: plaintext); raises
        :class:`~kvshard.etcd_tls.EtcdTLSConfigError` naming an unreadable or non-PEM file."""
        return EtcdTLS.from_files(self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file,
                                  server_name=self.etcd_server_name, setting=f"{ENV_PREFIX}ETCD_*")

    def shard(self) -> tuple[str, str]:
        """``cacheshard`` as ``(namespace, name)``."""
        match = _SHARD.fullmatch(self.cacheshard)
        if match is None:
            raise settings_lib.SettingsError(
                f"cacheshard: {self.cacheshard!r} is not <namespace>/<name> (lowercase DNS labels)")
        return match["namespace"], match["name"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_lib.add_arguments(parser, RouterSettings, ENV_PREFIX)


def from_args(args: argparse.Namespace | None) -> RouterSettings:
    return settings_lib.from_sources(RouterSettings, args, ENV_PREFIX)
