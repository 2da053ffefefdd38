"""What the local cluster generates: its CacheShard and its Prometheus config (pure functions).

The CacheShard starts from ``cacheshard-local.yaml`` beside this module (a local variant of
``crds/examples/cacheshard-minimal.yaml``) or from a user's YAML, and only the fields that depend on
this run are overwritten: where etcd and Prometheus listen, and — for the generated one — the
catalog (with its refresh interval), the prompt, the cluster count and the rebalance interval. So
``kvshard up --dataset items.jsonl --prompt prompt.yaml`` serves a user's own catalog under their
own prompt with no sidecar setting: the sidecars learn both from the CacheShard. A prompt file is
checked here, before anything starts, with the same rules the operator applies.

Prometheus scrapes every process the cluster runs; sidecar targets carry a static ``pod`` label
(the rebalancer joins hit rates on it) while the router's target carries none, because the
router's own samples already name the pod they count.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvshard.datasets import BUILTIN_DATASETS
from kvshard.prompt_template import PromptTemplate, TemplateError

TEMPLATE = Path(__file__).with_name("cacheshard-local.yaml")
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def catalog_source(dataset: str) -> dict[str, Any]:
    """``spec.catalog`` for a sidecar ``--dataset`` value: a built-in name, a folder or a JSONL file."""
    if dataset in BUILTIN_DATASETS:
        return {"builtin": dataset}
    path = Path(dataset).expanduser().resolve()
    items = path / "items.jsonl" if path.is_dir() else path
    return {"file": {"path": str(items)}}


def load_prompt(path: Path) -> dict[str, str]:
    """``spec.prompt`` from a YAML (or JSON) file holding its fields (``systemText``, ``itemFormat``,
    …), checked as the operator checks it; ``ValueError`` naming the file and the field otherwise."""
    try:
        obj = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"prompt file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"prompt file {path}: not YAML ({exc})") from None
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"prompt file {path}: expected a mapping of spec.prompt fields (systemText, historyHeader, "
                         "candidatesHeader, question, itemFormat, labelPosition)")
    try:
        template = PromptTemplate.from_spec(obj)
    except (TemplateError, TypeError) as exc:
        raise ValueError(f"prompt file {path}: {exc}") from None
    return {spec: value for spec, value in template.as_spec().items() if spec in obj}


def load_cacheshard(path: Path | None = None) -> dict[str, Any]:
    """The CacheShard in ``path`` (default: the local template), checked to be one."""
    source = path or TEMPLATE
    try:
        obj = yaml.safe_load(source.read_text())
    except OSError as exc:
        raise ValueError(f"CacheShard file {source}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"CacheShard file {source}: not YAML ({exc})") from None
    if not isinstance(obj, dict) or obj.get("kind") != "CacheShard" or not isinstance(obj.get("spec"), dict):
        raise ValueError(f"{source}: not a CacheShard manifest (kind: CacheShard with a spec)")
    if not (obj.get("metadata") or {}).get("name"):
        raise ValueError(f"{source}: metadata.name is required")
    return obj


def local_cacheshard(base: Mapping[str, Any], *, namespace: str, etcd_endpoint: str, prometheus_url: str,
                     generated: bool, dataset: str = "movielens-100k", clusters: int = 12,
                     rebalance_interval_seconds: int = 15, etcd_tls_secret: str | None = None,
                     prompt: Mapping[str, str] | None = None, catalog_refresh_seconds: int = 10,
                     blend: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``base`` pointed at this run's etcd (over TLS with the client certificate in the Secret
    ``etcd_tls_secret``, when given) and Prometheus; ``generated`` also sets catalog (re-read every
    ``catalog_refresh_seconds`` unless built in), clusters, the rebalance interval and the ``blend``
    fields the model calls for where ``spec.blend`` leaves them unset (a user's YAML keeps its own);
    ``prompt``, when given, becomes ``spec.prompt`` of either."""
    obj = copy.deepcopy(dict(base))
    obj.setdefault("apiVersion", "kvshard.io/v1alpha1")
    meta = obj.setdefault("metadata", {})
    meta["namespace"] = namespace
    spec = obj["spec"]
    spec["etcd"] = {**(spec.get("etcd") or {}), "endpoints": [etcd_endpoint]}
    if etcd_tls_secret:
        spec["etcd"]["tls"] = {"secretRef": {"name": etcd_tls_secret}}
    else:
        spec["etcd"].pop("tls", None)  # a user's TLS settings are for their etcd, not this one
    spec["prometheus"] = {**(spec.get("prometheus") or {}), "url": prometheus_url}
    if prompt:  # asked for on the command line: it wins over a user's YAML too
        spec["prompt"] = dict(prompt)
    if generated:
        spec["catalog"] = catalog_source(dataset)
        if "builtin" not in spec["catalog"]:
            spec["catalog"]["refreshSeconds"] = catalog_refresh_seconds
        spec["clusters"] = clusters
        spec["rebalance"] = {**(spec.get("rebalance") or {}), "enabled": True,
                             "intervalSeconds": rebalance_interval_seconds}
        if blend:
            spec["blend"] = {**blend, **(spec.get("blend") or {})}
    return obj


def as_applied(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` as ``kubectl apply`` would create it (``kubectl create --save-config``): with the
    last-applied annotation, so a later ``kubectl apply -f <run>/cacheshard.yaml`` merges three ways."""
    out = copy.deepcopy(dict(obj))
    annotations = out.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[LAST_APPLIED] = json.dumps(obj, separators=(",", ":"), sort_keys=True)
    return out


def prometheus_config(*, scrape_interval_seconds: float, sidecars: Mapping[str, str], router: str | None,
                      operator: str | None, namespace: str = "") -> dict[str, Any]:
    """``prometheus.yml``: targets are ``host:port``; ``sidecars`` maps pod name → target. Sidecars
    carry ``pod`` and ``namespace`` labels as a ServiceMonitor gives them in a cluster, so the
    chart's autoscaling query selects them unchanged."""
    interval = f"{max(1, round(scrape_interval_seconds * 1000))}ms"
    where = {"namespace": namespace} if namespace else {}
    jobs: list[dict[str, Any]] = [{
        "job_name": "kvshard-sidecar",
        "static_configs": [{"targets": [target], "labels": {"pod": pod, **where}}
                           for pod, target in sorted(sidecars.items())],
    }]
    if router:
        jobs.append({"job_name": "kvshard-router", "static_configs": [{"targets": [router]}]})
    if operator:
        jobs.append({"job_name": "kvshard-operator", "static_configs": [{"targets": [operator]}]})
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": jobs}
