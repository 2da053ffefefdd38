"""The local cluster's one settings object: flags, then ``KVSHARD_LOCAL_*`` env, then defaults.

The defaults are sized for a laptop or a small CI box: three sidecars with one torch thread each
(three sidecars on two cores fight for the CPU otherwise), a small memory tier, and a Prometheus
that scrapes every two seconds so the rebalancer sees fresh rates within one interval.

``engine``: who computes in the pods. ``embedded`` (default): each sidecar holds the model and runs
the blend engine. ``vllm``: each pod also runs its own vLLM server (the pod's "vLLM container",
:class:`kvshard_local.kubelet.PodContainers`) with kvshard's KV connector on the pod's block store, and
its sidecar holds no weights — the production shape for a scorer model. A vLLM takes a minute or more
to start on a small CPU box, so the start timeout's default grows with it (:data:`VLLM_START_TIMEOUT`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvshard import settings as settings_lib
from kvshard.models import DEFAULT_MODEL, MODEL_HELP
from kvshard.paths import cache_dir
from kvshard.settings import setting

ENV_PREFIX = "KVSHARD_LOCAL_"
MiB = 1 << 20
START_TIMEOUT = 300.0
"""Default ``start_timeout_seconds``: sidecars that load a 135M model and warm their clusters."""
VLLM_START_TIMEOUT = 900.0
"""Default ``start_timeout_seconds`` with ``engine: vllm``: measured, one vLLM alone starts in 60–90 s on
two cores (two started at once: ~80 s), and the pods' warm-up then goes through them."""


@dataclass(frozen=True)
class LocalClusterSettings:
    pods: int = setting(3, "sidecar pods to run (engine-0 … engine-{N-1})")
    dir: Path | None = setting(None, "run folder: logs, etcd data, kubeconfig, cluster.json "
                               "(default: <user cache>/local-cluster)")
    cacheshard: Path | None = setting(None, "CacheShard YAML to apply (default: generated from the local template; "
                                      "its etcd endpoints and Prometheus URL are pointed at the local ones)")
    dataset: str = setting("movielens-100k", "catalog of the generated CacheShard (spec.catalog; the sidecars load "
                           "it from etcd): a built-in name, your own items.jsonl ({\"id\", \"text\", other fields} a "
                           "line) or a folder holding one; replace the file and the change flows to the pods")
    prompt: Path | None = setting(None, "YAML file with the CacheShard's spec.prompt, generated or --cacheshard "
                                  "(systemText, historyHeader, candidatesHeader, question, itemFormat such as "
                                  "'{text} by {author}', labelPosition before|after; default: the MovieLens prompt)")
    catalog_refresh_seconds: int = setting(10, "spec.catalog.refreshSeconds of the generated CacheShard: how often the "
                                           "operator re-reads a file catalog (the CRD allows 5 or more)")
    model: str = setting(DEFAULT_MODEL, f"model the sidecars serve: {MODEL_HELP}")
    engine: Literal["embedded", "vllm"] = setting(
        "embedded", "who computes in each pod: 'embedded' (the sidecar's blend engine) or 'vllm' (each pod also runs "
        "its own vLLM server with kvshard's KV connector on the pod's block store; the sidecar holds no weights and "
        "vLLM computes what no block holds). vllm needs a scorer model (--model late or scorer) and the vllm extra; "
        "a vLLM takes 60-90 s to start on 2 cores, and each pod's vLLM holds ~4 GiB of memory (its KV cache 1 GiB)")
    namespace: str = setting("default", "namespace of the pods and the CacheShard")
    clusters_per_pod: int = setting(4, "item clusters per pod in the generated CacheShard")
    rebalance_interval_seconds: int = setting(15, "spec.rebalance.intervalSeconds of the generated CacheShard "
                                              "(the CRD allows 10 or more)")
    memory_bytes: int = setting(512 * MiB, "memory tier budget of each sidecar in bytes")
    threads: int = setting(1, "torch threads per sidecar (OMP_NUM_THREADS); keep pods × threads ≤ cores")
    router_policy: str = setting("affinity", "routing policy of the router")
    scrape_interval_seconds: float = setting(2.0, "Prometheus scrape interval")
    start_timeout_seconds: float = setting(START_TIMEOUT, "how long to wait for the sidecars' models and for warm-up "
                                           f"(default {START_TIMEOUT:.0f} s; with engine vllm the default is "
                                           f"{VLLM_START_TIMEOUT:.0f} s: every pod starts its own vLLM)")
    ttft_target_seconds: float = setting(10.0, "TTFT each sidecar is sized for (the latency half of its pressure "
                                         "gauge); CPU prefills are slow, so higher than the chart's")
    pressure_window_seconds: float = setting(15.0, "window of the sidecars' TTFT p90 in the pressure gauge")
    embedding_jobs: bool = setting(True, "the operator embeds the catalog through Indexed Jobs on <run>/embeddings, "
                                   "run here as one process per chunk (as in a cluster with a shared volume); "
                                   "false: it embeds in its own process")
    autoscale: bool = setting(False, "run the autoscaler loop: the chart's KEDA query on this Prometheus, "
                              "the chart's replica rule and behaviour (kvshard.autoscaling)")
    autoscale_values: Path | None = setting(None, "YAML with a chart-style `autoscaling:` map (minReplicas, "
                                            "maxReplicas, targetPressure, pressureWindow, behavior); default: "
                                            "laptop-sized windows (kvshard_local.scaling.LOCAL_AUTOSCALING)")
    autoscale_period_seconds: float = setting(5.0, "seconds between two evaluations (the HPA's sync period)")

    def __post_init__(self) -> None:
        for name in ("pods", "clusters_per_pod", "threads"):
            if getattr(self, name) < 1:
                raise settings_lib.SettingsError(f"{name} must be >= 1")
        if self.catalog_refresh_seconds < 5:
            raise settings_lib.SettingsError("catalog_refresh_seconds must be >= 5 (the CRD's minimum)")
        if self.rebalance_interval_seconds < 10:
            raise settings_lib.SettingsError("rebalance_interval_seconds must be >= 10 (the CRD's minimum)")
        if self.memory_bytes < 0:
            raise settings_lib.SettingsError("memory_bytes must be >= 0")
        if min(self.ttft_target_seconds, self.pressure_window_seconds, self.autoscale_period_seconds) <= 0:
            raise settings_lib.SettingsError("ttft_target_seconds, pressure_window_seconds and "
                                             "autoscale_period_seconds must be > 0")
        if self.engine == "vllm" and self.start_timeout_seconds == START_TIMEOUT:  # the default, not a choice
            object.__setattr__(self, "start_timeout_seconds", VLLM_START_TIMEOUT)
        if self.scrape_interval_seconds <= 0 or self.start_timeout_seconds <= 0:
            raise settings_lib.SettingsError("scrape_interval_seconds and start_timeout_seconds must be > 0")

    @property
    def run_dir(self) -> Path:
        return Path(self.dir or cache_dir() / "local-cluster").expanduser().resolve()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_lib.add_arguments(parser, LocalClusterSettings, ENV_PREFIX)


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvshard up`` (kept here, beside the settings, so ``kvshard --help`` stays light)."""
    add_arguments(parser)
    parser.add_argument("--no-wait", action="store_true",
                        help="print the process table as soon as everything started, without waiting for the "
                        "CacheShard to be Ready and every pod warm")


def add_down_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvshard down``."""
    parser.add_argument("--dir", type=Path, default=None,
                        help=f"run folder of the cluster to stop [env {ENV_PREFIX}DIR; default: "
                        "<user cache>/local-cluster]")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for `kvshard up` to stop before killing what is left (default: 60)")


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvshard scale``."""
    parser.add_argument("--pods", type=int, required=True, help="sidecar pods to run (>= 1)")
    parser.add_argument("--dir", type=Path, default=None,
                        help=f"run folder of the cluster [env {ENV_PREFIX}DIR; default: <user cache>/local-cluster]")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds to wait for the change, drains included (default: 180)")


def from_args(args: argparse.Namespace | None) -> LocalClusterSettings:
    return settings_lib.from_sources(LocalClusterSettings, args, ENV_PREFIX)
