"""The sidecar's one settings object: flags, then ``KVSHARD_SIDECAR_*`` env, then defaults.

Byte budgets are integers of bytes (as in the CacheShard spec); the peer token comes from a file
(a mounted Kubernetes Secret) or the environment, never a flag, so it stays out of process lists. The
etcd TLS files (CA, client certificate and key: a mounted Secret) are paths, read whenever the sidecar
opens an etcd session, so a renewed certificate is used from the next session on.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvshard import settings as settings_lib
from kvshard.blend_policy import DEFAULT_METHOD, DEFAULT_RATIO, BlendPolicyError, check_method
from kvshard.etcd_tls import EtcdTLS, files_problem
from kvshard.models import DEFAULT_MODEL, MODEL_HELP
from kvshard.paths import cache_dir
from kvshard.settings import setting

ENV_PREFIX = "KVSHARD_SIDECAR_"
GiB = 1 << 30
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_SHARD = re.compile(rf"{_DNS_LABEL}/{_DNS_LABEL}(\.{_DNS_LABEL})*")
_HOST_PORT = re.compile(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")


@dataclass(frozen=True)
class SidecarSettings:
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 in a pod)")
    port: int = setting(8100, "HTTP port of the sidecar API")
    pod_name: str = setting("", "this pod's name (placement assigns clusters to pod names); default: host:port")
    model: str = setting(DEFAULT_MODEL, f"model to serve: {MODEL_HELP}")
    dtype: str = setting("float32", "model dtype", choices=("float32", "bfloat16", "float16"))
    device: str = setting("cpu", "torch device (cpu, cuda, cuda:1, …)")
    dataset: str = setting("movielens-100k", "item catalog when following no CacheShard: a built-in name, a folder "
                           "or an items JSONL file. With --etcd-endpoints the catalog and the prompt come from the "
                           "CacheShard (the version its placement names); this one only serves until then")
    memory_bytes: int = setting(2 * GiB, "memory tier budget in bytes")
    disk_dir: Path | None = setting(None, "disk tier folder (default: <user cache>/blocks/<pod>)")
    disk_bytes: int = setting(20 * GiB, "disk tier budget in bytes (0 disables the disk tier)")
    peers: tuple[str, ...] = setting((), "peer sidecar base URLs asked on a local miss (comma-separated)")
    peer_token_file: Path | None = setting(None, "file holding the shared peer token (a mounted Secret)")
    peer_token: str = setting("", "the shared peer token itself (env only; prefer the file)", secret=True)
    peer_timeout_seconds: float = setting(2.0, "timeout of one peer block fetch")
    max_concurrency: int = setting(1, "requests computed at once (the model is one device)")
    max_queue: int = setting(8, "requests allowed to wait; beyond that the sidecar answers 429")
    vllm_concurrency: int = setting(8, "requests admitted at once when vLLM computes (a scorer model with --engine "
                                    "vllm: the sidecar runs no forward and vLLM batches across requests); size it so "
                                    "this many recommendations' candidates fit vLLM's --max-num-seqs")
    vllm_max_num_seqs: int = setting(64, "vLLM's --max-num-seqs when it computes: the pressure gauge's queue term "
                                     "is then (vLLM's running + waiting sequences) / this, read from vLLM's /metrics")
    ttft_target_seconds: float = setting(2.0, "TTFT the pod is sized for: the latency half of the pressure gauge "
                                         "the autoscaler scales on is TTFT p90 / this")
    pressure_window_seconds: float = setting(60.0, "window of the TTFT p90 in the pressure gauge")
    drain_settle_seconds: float = setting(1.0, "after a drain withdrew the pod from routing, how long no request "
                                          "may arrive before the drain reports done (the router's last choices)")
    max_candidates: int = setting(80, "most candidates one request may carry")
    max_history: int = setting(200, "most history items one request may carry")
    max_new_tokens: int = setting(32, "largest max_tokens a request may ask for")
    max_prompt_tokens: int = setting(0, "longest prompt (plus max_tokens) served; 0 = the model's context length")
    method: str = setting(DEFAULT_METHOD, "default blend method, NAME[+CORRECTION...] (kvshard.blend_policy); "
                          "a followed CacheShard's blend settings in force replace it without a restart")
    selector: str = setting("", "a plain blend selector instead of --method (empty: the method's)",
                            choices=("", "none", "boundary", "deviation", "hybrid", "tail"))
    ratio: float = setting(DEFAULT_RATIO, "default recompute ratio r")
    shadow_budget_percent: int = setting(10, "share of wall-clock time shadow checks (a full prefill of a sampled "
                                         "request, run only while no request waits) may use, in percent")
    shadow_sample_rate: float = setting(0.0, "share of requests shadow-checked when following no CacheShard "
                                        "(a followed CacheShard's spec.fidelity.sampleRatePercent replaces it)")
    engine: Literal["embedded", "vllm"] = setting("embedded", "who decodes: the blend engine or vLLM")
    vllm_url: str = setting("", "vLLM's base URL when --engine vllm (e.g. http://127.0.0.1:8000)")
    vllm_model: str = setting("", "the model name vLLM serves (--served-model-name); default: the model's name")
    exchange_dir: Path = setting(Path("/dev/shm/kvshard-exchange"), "KV exchange folder shared with vLLM")
    etcd_endpoints: tuple[str, ...] = setting(
        (), "etcd host:port list (comma-separated) to follow placement from; empty = static --peers, no placement")
    cacheshard: str = setting("", "<namespace>/<name> of the CacheShard whose placement this pod follows")
    advertise_url: str = setting("", "base URL peers and the router reach this sidecar at "
                                     "(default http://<host>:<port>; in a pod http://$(POD_IP):8100)")
    etcd_username: str = setting("", "etcd user (env only)", secret=True)
    etcd_password: str = setting("", "etcd password (env only)", secret=True)
    etcd_ca_file: Path | None = setting(None, "CA certificate (PEM) that signed etcd's server certificate; "
                                        "set, the sidecar talks TLS to etcd (the Secret's ca.crt)")
    etcd_cert_file: Path | None = setting(None, "client certificate (PEM) the sidecar presents to etcd "
                                          "(client-cert auth; tls.crt); needs the key and the CA file")
    etcd_key_file: Path | None = setting(None, "private key (PEM) of the etcd client certificate (tls.key)")
    etcd_server_name: str = setting("", "name etcd's server certificate must carry (empty: the host of the "
                                    "first endpoint)")
    blend_wait_seconds: float = setting(
        30.0, "following a CacheShard: how long /readyz waits, after the model loaded, for the CacheShard's blend "
              "settings from etcd (the fidelity guard may have moved the ratio off the flags'); past it the pod "
              "becomes ready with the flags' settings and says so in its log (etcd unreachable at start)")
    warm_history_users: int = setting(
        0, "users whose history blocks are warmed ahead, most active first (their last max_history items). "
           "Warming costs one prefill per user at startup and memory/disk for blocks that may never be asked "
           "for; 0 computes a history block on the user's first request and keeps it (LRU) — the first "
           "request of each user then pays that prefill")

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "disk_bytes", "max_queue", "max_prompt_tokens", "blend_wait_seconds"):
            if getattr(self, name) < 0:
                raise settings_lib.SettingsError(f"{name} must be >= 0")
        for name in ("max_concurrency", "vllm_concurrency", "vllm_max_num_seqs", "max_candidates", "max_new_tokens",
                     "port"):
            if getattr(self, name) < 1:
                raise settings_lib.SettingsError(f"{name} must be >= 1")
        if not 0.0 <= self.ratio <= 1.0:
            raise settings_lib.SettingsError("ratio must be in [0, 1]")
        if not 0.0 <= self.shadow_sample_rate <= 1.0:
            raise settings_lib.SettingsError("shadow_sample_rate must be in [0, 1]")
        if not 0 <= self.shadow_budget_percent <= 100:
            raise settings_lib.SettingsError("shadow_budget_percent must be in [0, 100]")
        try:
            check_method(self.method)
        except BlendPolicyError as error:
            raise settings_lib.SettingsError(f"method: {error}") from None
        if min(self.ttft_target_seconds, self.pressure_window_seconds) <= 0 or self.drain_settle_seconds < 0:
            raise settings_lib.SettingsError("ttft_target_seconds and pressure_window_seconds must be > 0, "
                                             "drain_settle_seconds >= 0")
        if self.engine == "vllm" and not self.vllm_url:
            raise settings_lib.SettingsError("--engine vllm needs --vllm-url")
        if self.warm_history_users < 0:
            raise settings_lib.SettingsError("warm_history_users must be >= 0")
        if self.etcd_endpoints:
            if not self.cacheshard:
                raise settings_lib.SettingsError("--etcd-endpoints needs --cacheshard <namespace>/<name>")
            bad = [e for e in self.etcd_endpoints if not _HOST_PORT.fullmatch(e)]
            if bad:
                raise settings_lib.SettingsError(f"etcd_endpoints: {', '.join(bad)} is not host:port")
        problem = files_problem(self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file)
        if problem:
            raise settings_lib.SettingsError(f"{ENV_PREFIX}ETCD_CA_FILE/_CERT_FILE/_KEY_FILE: {problem}")
        if self.cacheshard and not _SHARD.fullmatch(self.cacheshard):
            raise settings_lib.SettingsError(
                f"cacheshard: {self.cacheshard!r} is not <namespace>/<name> (lowercase DNS labels)")
        if self.advertise_url and not self.advertise_url.startswith(("http://", "https://")):
            raise settings_lib.SettingsError(f"advertise_url: {self.advertise_url!r} must start with http(s)://")

    @property
    def name(self) -> str:
        return self.pod_name or f"{self.host}:{self.port}"

    @property
    def shard(self) -> tuple[str, str]:
        """``(namespace, name)`` of the followed CacheShard (``--cacheshard``)."""
        namespace, _, name = self.cacheshard.partition("/")
        return namespace, name

    @property
    def url(self) -> str:
        """Where others reach this sidecar: ``--advertise-url`` or ``http://<host>:<port>``."""
        return (self.advertise_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def disk_root(self) -> Path | None:
        if self.disk_bytes == 0:
            return None
        return self.disk_dir or cache_dir() / "blocks" / self.name.replace(":", "-").replace("/", "-")

    def etcd_tls(self) -> EtcdTLS | None:
        """The etcd TLS material read from its files now (``None``: plaintext); raises
        :class:`~kvshard.etcd_tls.EtcdTLSConfigError` naming an unreadable or non-PEM file."""
        return EtcdTLS.from_files(self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file,
                                  server_name=self.etcd_server_name, setting=f"{ENV_PREFIX}ETCD_*")

    def token(self) -> str:
        """The shared peer token ('' disables peer serving and fetching)."""
        if self.peer_token_file is not None:
            return self.peer_token_file.read_text().strip()
        return self.peer_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_lib.add_arguments(parser, SidecarSettings, ENV_PREFIX)


def from_args(args: argparse.Namespace | None) -> SidecarSettings:
    return settings_lib.from_sources(SidecarSettings, args, ENV_PREFIX)
