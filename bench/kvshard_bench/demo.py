"""``kvshard demo`` (``make demo``): the whole system on this machine, end to end.

Brings up the local cluster (etcd, Prometheus, the emulated Kubernetes API with the operator, N
sidecar pods, the router), applies the example CacheShard and waits for ``Ready`` and warm pods,
then replays MovieLens sessions through the router in three phases:

1. **steady** — session requests whose candidates are a retrieval stage's output (:mod:`demo_trace`;
   ``--candidate-set retrieval``, the default: item-kNN over the training users, held-out users'
   sessions, the target only where retrieved; ``neighbours``: the target plus embedding neighbours);
2. **burst** — a share of requests take their candidates from one or two clusters held by a single
   pod (a trending topic), until the operator's rebalancer publishes a new placement generation and
   its new holders report warm (bounded by ``--burst-timeout``);
3. **after** — the same burst mix on the rebalanced placement, for at least two rebalance intervals.

:mod:`demo_watch` reads the placement generation and the warm reports from etcd once a second (what
the router and sidecars follow) and the CacheShard's conditions every few seconds. At the end, a sample
of the same requests is re-sent one at a time straight to the sidecar that served it, blended and
with ``blend.method = full`` (exact full prefill), for TTFT, agreement of the chosen candidate and the
quality of both rankings against the item the user rated next — with retrieval-stage candidates, beside
the retrieval stage's own order (all session requests, a missed target scoring 0, and the retrieved
ones). The replay runs in :mod:`demo_replay`; the numbers and the picture come from :mod:`demo_report`; files
go to ``--out`` (default ``<user cache>/demo``).

After the replay, :mod:`demo_ramp` runs a load ramp (``--no-ramp``: none): the cluster goes to the
autoscaling rules' minimum (two pods), the chart's autoscaler runs against the local Prometheus, and load
through the router rises until it adds a pod, then falls until it removes one; ``ramp.json`` and
``ramp.png`` hold its timeline, the summary its decisions, moved clusters and hit ratios.

``--engine vllm`` (or ``KVSHARD_LOCAL_ENGINE=vllm``) runs every pod with its own vLLM server, which
computes what no block holds (:class:`~kvshard_local.settings.LocalClusterSettings`, ``engine``). Those
sidecars hold no weights, so they cannot compute the full-prefill reference: the demo computes it
itself, in this process, with the blend engine (:mod:`demo_reference`) — the agreement then compares
what vLLM served with an exact full prefill that shares nothing with vLLM. On a small CPU box the vLLM
defaults are smaller (:data:`VLLM_DEFAULTS`: two pods), and the ramp's third pod starts its vLLM while
the load runs; it takes traffic only once warm, as every new pod does.

Before the replay the demo sets a fidelity target on its CacheShard (``spec.fidelity``,
``--fidelity-target`` 90 % by default, 0: none): the sidecars shadow-check a share of the requests and
the operator moves the recompute ratio to meet the target; :mod:`demo_fidelity` reports its decisions.

The exit code says whether the demo showed what it set out to (:mod:`demo_verdict`, printed last and kept
in ``summary.json``): 1 when any request failed (replay, re-sent pairs, ramp), when agreement with full
prefill is below ``--fidelity-target``, or when the ramp (``--ramp``) did not complete.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Literal, cast

from kvshard.datasets import Dataset, load_dataset
from kvshard.models import MEASURED_MODEL
from kvshard.paths import cache_dir
from kvshard.settings import SettingsError, env_setting
from kvshard_bench import demo_fidelity, demo_ramp
from kvshard_bench import demo_report as report
from kvshard_bench.demo_replay import Replay
from kvshard_bench.demo_trace import (
    CANDIDATE_SETS,
    CandidateSet,
    DemoTrace,
)
from kvshard_bench.demo_verdict import verdict

log = logging.getLogger(__name__)

ENGINES = ("embedded", "vllm")
DEFAULT_PODS = 3
VLLM_DEFAULTS: dict[str, Any] = {"pods": 2}
"""What ``--engine vllm`` changes when ``--pods`` is not given: two pods. Each pod's vLLM holds ~4 GiB and
wants a core to answer in seconds, and the ramp adds a third pod with its own vLLM (measured on a
2-core, 24 GiB machine: two vLLMs start together in ~80 s)."""


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    pods: int = DEFAULT_PODS
    model: str = MEASURED_MODEL
    engine: Literal["embedded", "vllm"] = "embedded"
    """Who computes in the pods: the sidecars' blend engine, or each pod's own vLLM (``vllm``)."""
    requests: int = 160
    users: int = 32
    out: Path | None = None
    keep_running: bool = False
    concurrency: int = 3
    pairs: int = 20
    hot_clusters: int = 2
    burst_timeout_s: float = 150.0
    seed: int = 0
    fidelity_target: int = 90
    """spec.fidelity.targetAgreementPercent (0: no fidelity guard)."""
    fidelity_sample_rate: int = 10
    fidelity_interval_s: int = 20
    ramp: bool = True
    """After the replay, a load ramp the autoscaler answers (:mod:`demo_ramp`)."""
    ramp_timeout_s: float = 600.0
    candidate_set: CandidateSet = "retrieval"
    """Session requests' candidates (:class:`~kvshard_bench.demo_trace.DemoTraceSettings`): the retrieval
    stage's, so the quality table means what a reranker in production faces, or embedding neighbours."""

    @property
    def out_dir(self) -> Path:
        return (self.out or cache_dir() / "demo").expanduser().resolve()

    def fidelity_spec(self) -> dict[str, Any] | None:
        """``spec.fidelity`` the demo sets on its CacheShard (None: no target)."""
        if not self.fidelity_target:
            return None
        return demo_fidelity.fidelity_spec(self.fidelity_target, self.fidelity_sample_rate, self.fidelity_interval_s)

    def plan(self) -> tuple[int, int, int]:
        """Requests of the steady phase, the burst's minimum, and the after phase (of ``requests``)."""
        steady = max(1, round(self.requests * 0.3))
        burst = max(1, round(self.requests * 0.3))
        return steady, burst, max(1, self.requests - steady - burst)


def settings_from(args: argparse.Namespace) -> DemoSettings:
    """The settings from ``kvshard demo``'s flags (defined in ``kvshard/cli.py``). ``--engine`` falls back to
    ``KVSHARD_LOCAL_ENGINE`` (as ``kvshard up``'s does), and ``--pods`` left unset to the engine's default."""
    from kvshard_local.settings import ENV_PREFIX as LOCAL_ENV_PREFIX
    from kvshard_local.settings import LocalClusterSettings

    try:
        engine = getattr(args, "engine", None) or env_setting(LocalClusterSettings, LOCAL_ENV_PREFIX, "engine")
    except SettingsError as exc:
        raise SystemExit(f"kvshard demo: {exc}") from None
    if engine not in ENGINES:
        raise SystemExit(f"kvshard demo: --engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if getattr(args, "pods", None) is None:
        args.pods = VLLM_DEFAULTS["pods"] if engine == "vllm" else DEFAULT_PODS
    candidate_set = getattr(args, "candidate_set", None) or DemoSettings.candidate_set
    if candidate_set not in CANDIDATE_SETS:
        raise SystemExit(f"kvshard demo: --candidate-set must be one of {', '.join(CANDIDATE_SETS)}, "
                         f"got {candidate_set!r}")
    for name in ("pods", "requests", "users", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvshard demo: --{name} must be at least 1")
    settings = DemoSettings(pods=args.pods, model=args.model, engine=cast(Literal["embedded", "vllm"], engine),
                            requests=args.requests,
                            users=args.users, out=args.out,
                            keep_running=args.keep_running, concurrency=args.concurrency, pairs=max(0, args.pairs),
                            burst_timeout_s=args.burst_timeout, seed=args.seed,
                            fidelity_target=args.fidelity_target, fidelity_sample_rate=args.fidelity_sample_rate,
                            fidelity_interval_s=args.fidelity_interval, ramp=args.ramp,
                            ramp_timeout_s=args.ramp_timeout,
                            candidate_set=cast(CandidateSet, candidate_set))
    if settings.ramp_timeout_s <= 0:
        raise SystemExit("kvshard demo: --ramp-timeout must be > 0")
    try:
        settings.fidelity_spec()
    except ValueError as exc:
        raise SystemExit(f"kvshard demo: {exc}") from exc
    return settings


def run(args: argparse.Namespace) -> int:
    from kvshard_local import ClusterAlreadyRunningError, ClusterStartError, LocalCluster, LocalClusterSettings

    settings = settings_from(args)
    out = settings.out_dir
    out.mkdir(parents=True, exist_ok=True)
    print(f"kvshard demo: output folder {out}", flush=True)
    started = time.monotonic()
    dataset = load_dataset("movielens-100k")
    try:
        cluster_settings = LocalClusterSettings(pods=settings.pods, model=settings.model, dir=out / "cluster",
                                                engine=settings.engine)
        cluster = LocalCluster(cluster_settings)
    except ValueError as exc:  # e.g. --engine vllm with a model that is not a scorer
        print(f"kvshard demo: {exc}", flush=True)
        return 2
    try:
        with cluster:
            engine = ", each with its own vLLM" if settings.engine == "vllm" else ""
            print(f"local cluster: {settings.pods} pods{engine}, router {cluster.router_url}, "
                  f"Prometheus {cluster.prometheus_url}, logs in {cluster.logs_dir}", flush=True)
            cluster.wait_ready(cluster_settings.start_timeout_seconds)
            print(f"CacheShard {cluster.namespace}/{cluster.name} is Ready after {time.monotonic() - started:.0f} s",
                  flush=True)
            return _replay_and_report(cluster, dataset, settings, started)
    except (TimeoutError, ClusterStartError, ClusterAlreadyRunningError) as exc:
        print(f"kvshard demo: the local cluster did not come up: {exc}\nlogs: {cluster_settings.run_dir / 'logs'}",
              flush=True)
        return 1


def _replay_and_report(cluster: Any, dataset: Dataset, settings: DemoSettings, started: float) -> int:
    out = settings.out_dir
    result = asyncio.run(Replay(cluster, dataset, settings).run())
    ramp, ramp_files = _ramp(cluster, result.trace, settings) if settings.ramp else (None, [])
    wall = time.monotonic() - started
    spec = settings.fidelity_spec()
    fidelity = demo_fidelity.summarize(result.fidelity, spec) if spec else None
    summary = report.summarize(result.records, result.pairs, result.samples, result.changes, result.pods, wall,
                               notes=result.notes, fidelity=fidelity, ramp=ramp, pairs_failed=result.pairs_failed)
    outcome = verdict(summary, fidelity_target_percent=settings.fidelity_target, ramp=settings.ramp,
                      pairs_wanted=settings.pairs)
    summary["verdict"] = outcome.as_json()
    text = report.render(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.txt").write_text(text + "\n")
    for filename, rows in (("requests.jsonl", result.records), ("placements.jsonl", result.samples)):
        with (out / filename).open("w") as f:
            f.writelines(json.dumps(dataclasses.asdict(row)) + "\n" for row in rows)
    png = report.plot(result.records, result.samples, result.pods, out / "placement.png", fidelity=result.fidelity,
                      target_percent=spec["targetAgreementPercent"] if spec else None)
    print("\n" + text + "\n")
    print(f"files: {out / 'summary.txt'}, {out / 'summary.json'}, {out / 'requests.jsonl'}, "
          f"{out / 'placements.jsonl'}, {png}{''.join(f', {f}' for f in ramp_files)}; "
          f"cluster logs in {cluster.logs_dir}", flush=True)
    for line in outcome.lines():
        print(line, flush=True)
    if settings.keep_running:
        print(f"the cluster keeps running: router {cluster.router_url}, Prometheus {cluster.prometheus_url}, "
              f"etcd {cluster.etcd_endpoint}; Ctrl-C stops it", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping the local cluster", flush=True)
    return outcome.code


def _ramp(cluster: Any, trace: DemoTrace | None, settings: DemoSettings) -> tuple[dict[str, Any], list[Path]]:
    """The autoscaling phase: the summary's section and the files written (``ramp.json``, ``ramp.png``).
    A ramp that cannot start or that fails is a note in the summary, not the end of the demo (the replay's
    results are still written), and fails the demo's exit code (:mod:`demo_verdict`)."""
    if trace is None:
        return {"outcome": "no ramp: the replay built no trace"}, []
    print(f"autoscaling ramp: at most {settings.ramp_timeout_s:.0f} s (--ramp-timeout)", flush=True)
    try:
        result = demo_ramp.run(cluster, lambda: trace.next().body(), settings.ramp_timeout_s,
                               progress=lambda line: print(line, flush=True))
    except Exception as exc:  # the replay's results stand whatever happens here
        log.exception("the autoscaling ramp failed")
        return {"outcome": f"the ramp failed: {type(exc).__name__}: {exc}"}, []
    if isinstance(result, str):
        print(result, flush=True)
        return {"outcome": result}, []
    doc = demo_ramp.document(result)
    path = settings.out_dir / "ramp.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    png = demo_ramp.plot(doc, settings.out_dir / "ramp.png")
    return demo_ramp.section(doc), [path, png]
