"""`kvshard bench routing`: which router makes best use of a sharded KV cache, under skew and a burst.

One trace (MovieLens-100k sessions, Zipf-skewed candidate popularity, a hot-cluster burst in the middle
fifth) is replayed against the same simulated pods with five routers — round-robin, least-loaded,
prefix-aware (production-stack's longest common prefix), kvshard affinity, and affinity with the
rebalance policy applied every interval — reporting for each: item-block hit ratio, load imbalance
(max/mean pod work per interval, averaged), and p99 time in system. The model and the trace are
described in :mod:`kvshard_bench.routing_sim`; nothing in them depends on which policy runs.

The affinity router weighs cached tokens against each pod's *backlog*, as the router service does
(:mod:`kvshard_router.backlog`): outstanding work in token equivalents, drained at rates learned from
answers; a request goes where backlog + its work there is least. Nothing in it is tuned to the
trace: the cached cost and overhead are the cost model's own. It also remembers the blocks it sent
each pod outside the placement (:mod:`kvshard_router.recent`), as many per pod as the simulated pods'
LRU keeps (``--recent-blocks``; 0 turns it off). ``--load inflight`` replays the earlier rule
instead, λ per in-flight request with λ = mean service time / (full − cached cost per token), so one
in-flight request weighs what it delays a newcomer by.

The rebalancer runs with θ = ``--hot-percent`` (150), pods hot above 115 % of the mean, drops allowed
to 105 %, and a budget of two warm-ups per pod per interval (``--move-budget``). These were chosen from
a small sweep (θ ∈ {125, 150, 200}, budget ∈ {8, 16, 32} on 16 pods): the burst needs ~30 warm-ups, so
with the library defaults (θ = 200, budget 8) it takes four intervals instead of two to settle.

``affinity+learned`` (issue 15) adds no replication: every interval the routers' co-request sketch
(:mod:`kvshard_router.corequest`) feeds the operator's colocation (:mod:`kvshard_operator.colocation`),
which swaps clusters between pods within a budget of two moves per pod, keeping each pod's request share
≤ 1.1 × the mean. ``--oracle`` adds ``affinity+oracle``: the same colocation computed in hindsight from
the whole trace, in place from the start — what learning could reach at best with this method.

Through the EPP front end (issue 43): the affinity row is replayed once more with every request sent
as Envoy's ext_proc messages to the endpoint picker's stream handler (:mod:`kvshard_router.epp`) and
the pod read back from its destination header; that row (``front_end: "epp"``) must match the HTTP
row's hit ratio, and ``same_choices_as_http`` says whether every one of its choices was the same.

Separately, the router's real decision time through both front ends — one item lookup, the affinity
choice and the chosen pod's cached tokens (:func:`kvshard_router.decision.decide`, as
:class:`~kvshard_router.picker.Picker` times it) — on a snapshot of ``--decision-pods`` pods and
``--items`` items (10 M by default), wall clock and thread CPU time, p50/p99; for the EPP over a real
loopback gRPC ext_proc server, with each request phase's end-to-end time beside it.

Targets (issue 6): affinity hit ratio ≥ 2× round-robin's and above prefix-aware's; with rebalancing,
imbalance ≤ 1.25 within two intervals after the burst starts. Issue 43: decision p99 < 100 µs at
1,000 pods / 10 M items through either front end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.placement_schema import Placement, WarmReport
from kvshard.rebalance import RebalanceSettings
from kvshard_bench import routing_sim as sim
from kvshard_router.backlog import Backlog
from kvshard_router.metrics import RouterMetrics
from kvshard_router.picker import Pick, Picker
from kvshard_router.policies import AffinityPolicy, LoadView, RouteRequest, RoutingPolicy, make_policy
from kvshard_router.settings import RouterSettings
from kvshard_router.snapshot import FloatArray, ItemIndex, Snapshot, build_snapshot
from kvshard_router.state import RouterState

TARGET_IMBALANCE = 1.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``kvshard bench routing``."""
    parser.add_argument("--pods", type=int, default=16, help="simulated pods (default 16)")
    parser.add_argument("--items", type=int, default=10_000_000,
                        help="items in the decision-time snapshot (default 10,000,000)")
    parser.add_argument("--decision-pods", type=int, default=1000, help="pods in the decision-time snapshot")
    parser.add_argument("--requests", type=int, default=60_000, help="requests replayed (default 60,000)")
    parser.add_argument("--candidates", type=int, default=20, help="candidate items per request (default 20)")
    parser.add_argument("--intervals", type=int, default=20, help="rebalance intervals over the trace")
    parser.add_argument("--utilization", type=float, default=0.7, help="offered load if every item block missed")
    parser.add_argument("--embeddings", choices=("genre", "minilm"), default="genre",
                        help="item vectors for clustering and retrieval (minilm is slow on CPU the first time)")
    parser.add_argument("--hot-percent", type=int, default=150,
                        help="rebalance θ: replicate clusters above this percent of the mean rate per replica")
    parser.add_argument("--move-budget", type=int, default=None,
                        help="replica warm-ups per rebalance interval (default: 2 per pod)")
    parser.add_argument("--oracle", action="store_true",
                        help="add an affinity+oracle row: the colocation learned from the whole trace in hindsight, "
                             "in place from the start (an upper bound for affinity+learned)")
    parser.add_argument("--load", choices=("backlog", "inflight"), default="backlog",
                        help="what the affinity router weighs cached tokens against: each pod's backlog with "
                             "the marginal-cost weight (the router's own, default) or λ per in-flight request")
    parser.add_argument("--recent-blocks", type=int, default=None,
                        help="blocks per pod the affinity router remembers sending outside the placement "
                             "(default: the simulated pods' LRU size, as a router set to its pods' cache; 0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of hit ratio and imbalance over time")


def decision_time(
    items: int, pods: int, candidates: int, *, rounds: int = 5, per_round: int = 1000, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Time the router's decision through both front ends on one synthetic snapshot of ``items`` items
    and ``pods`` pods (10 clusters per pod, 2 replicas each, ~5 % of pods with a backlog), in ``rounds``
    rounds of ``per_round`` fresh requests: the same requests, each front end with its own policy and
    backlog (as two processes). The decision is what :class:`~kvshard_router.picker.Picker` times for
    both: the one item lookup, the policy's choice and the chosen pod's cached tokens
    (:func:`~kvshard_router.decision.decide`), wall clock and thread CPU time. ``http`` calls the picker
    as the HTTP router does (nothing is forwarded, so its backlog stays as set up); ``epp`` is the real
    ext_proc server on loopback gRPC, played by an Envoy client in a process of its own (as Envoy is),
    which also times each request's messages end to end (headers and body out, the two answers back). On a shared
    machine a neighbour's burst can stall one round, so the reported p99 is the median of the rounds'
    p99s; the worst round and the pooled p99 are beside it."""
    rng = np.random.default_rng(seed)
    clusters = 10 * pods
    names = tuple(f"pod-{j:04d}" for j in range(pods))
    labels = rng.integers(0, clusters, items)
    built = time.perf_counter()
    index = ItemIndex.from_items(_Ids(items), labels)  # type: ignore[arg-type]
    assignment = {c: (names[c % pods], names[(c * 7 + 3) % pods]) for c in range(clusters)}
    warm = {p: [c for c, h in assignment.items() if p in h] for p in names}
    snapshot = build_snapshot(Placement(1, assignment, {}, pods=names), warm, items=index)
    build_s = time.perf_counter() - built
    backlogged = [(names[int(j)], int(rng.integers(1, 4))) for j in rng.choice(pods, size=max(1, pods // 20),
                                                                                  replace=False)]
    requests = [[RouteRequest(f"u{k}", tuple(f"item-{i}" for i in rng.integers(0, items, candidates)),
                              item_tokens=tuple(rng.integers(8, 40, candidates).tolist()), history_tokens=300)
                 for k in range(per_round)] for _ in range(rounds)]
    flat = [request for round_ in requests for request in round_]
    # the bench's requests carry token counts a JSON body does not: the body is the request's index
    http, epp = (_bench_picker(snapshot, backlogged, flat) for _ in range(2))
    for k in range(len(flat)):
        if k % per_round == 0:
            gc.collect()
        pick = http.pick(b"%d" % k)
        assert isinstance(pick, Pick)
        http.answered(pick, pick.pod)  # after the answer, off the decision's path
    messages = asyncio.run(_through_ext_proc(epp, len(flat), per_round))
    out = {"http": _percentiles(http.timings or [], rounds), "epp": _percentiles(epp.timings or [], rounds)}
    out["epp"]["message_p50_us"] = float(np.percentile(messages, 50)) / 1e3
    out["epp"]["message_p99_us"] = float(np.percentile(messages, 99)) / 1e3
    for timing in out.values():
        timing["snapshot_mb"], timing["snapshot_build_s"] = snapshot.nbytes / 1e6, build_s
    return out


def _bench_picker(snapshot: Snapshot, backlogged: list[tuple[str, int]], requests: list[RouteRequest]) -> Picker:
    """A picker over ``snapshot`` as the follower leaves the router's state (pods reachable at made-up
    addresses), with the router's own policy and a backlog on a few pods; it records decision times."""
    state = RouterState()
    state.snapshot = snapshot
    state.reports = {p: WarmReport(1, (), f"http://10.{j >> 16 & 255}.{j >> 8 & 255}.{j & 255}:8100")
                     for j, p in enumerate(snapshot.pods)}
    load = Backlog()  # what the router service decides with
    for pod, queued in backlogged:
        for _ in range(queued):
            load.start(pod, load.work(0, 400))
    policy = AffinityPolicy(recent_blocks_per_pod=RouterSettings().recent_blocks_per_pod)  # the router's own
    picker = Picker(state, policy, load, RouterMetrics(state, load, cacheshard=""),
                    parse=lambda raw: requests[int(raw)])
    picker.timings = []
    return picker


async def _through_ext_proc(picker: Picker, n: int, per_round: int) -> FloatArray:
    """Route requests ``0 … n-1`` through the ext_proc server on loopback, Envoy played from a process of
    its own (:mod:`kvshard_bench.envoy_player`), one stream per request as Envoy opens them; returns each
    request phase's end-to-end nanoseconds."""
    from kvshard_router import epp

    port = _free_port()
    server = await epp.start_grpc(picker, "127.0.0.1", port)
    try:
        player = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvshard_bench.envoy_player", f"127.0.0.1:{port}", str(n), str(per_round),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await player.communicate()
    finally:
        await server.stop(grace=None)
    if player.returncode:
        raise RuntimeError(f"the Envoy player failed ({player.returncode}): {err.decode()[-2000:]}")
    return np.array(json.loads(out), dtype=np.float64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentiles(timings: list[tuple[int, int]], rounds: int) -> dict[str, float]:
    both = np.array(timings, dtype=np.float64).reshape(rounds, -1, 2)
    wall, cpu = both[:, :, 0], both[:, :, 1]
    round_p99 = np.percentile(wall, 99, axis=1) / 1e3
    return {
        "decision_p50_us": float(np.percentile(wall, 50)) / 1e3,
        "decision_p99_us": float(np.median(round_p99)),
        "decision_p99_worst_round_us": float(round_p99.max()),
        "decision_p99_pooled_us": float(np.percentile(wall, 99)) / 1e3,
        "decision_cpu_p50_us": float(np.percentile(cpu, 50)) / 1e3,
        "decision_cpu_p99_us": float(np.median(np.percentile(cpu, 99, axis=1))) / 1e3,
    }


class _Recorded:
    """A policy that remembers its choices (to compare two front ends' runs on the same trace)."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        self.choices: list[str | None] = []

    def choose(self, request: RouteRequest, snapshot: Snapshot, load: LoadView) -> str | None:
        pod = self.policy.choose(request, snapshot, load)
        self.choices.append(pod)
        return pod

    def served(self, pod: str, request: RouteRequest, snapshot: Snapshot) -> None:
        served = getattr(self.policy, "served", None)
        if served is not None:
            served(pod, request, snapshot)


class _ThroughEpp:
    """A routing policy for the simulator that sends every request through the EPP front end: a JSON
    body in Envoy's ext_proc messages to :class:`~kvshard_router.epp.ExtProcStream`, the destination
    header back, then the upstream's 2xx response headers (so the affinity policy learns what the pod
    now holds, as it does on the HTTP router's answers). The picker decides with ``policy`` on the
    simulator's snapshot and backlog; the simulator accounts each request's work itself on its clock, so
    the stream does not. The body's routing view is the trace's request (its token counts included)."""

    def __init__(self, policy: RoutingPolicy, pods: tuple[str, ...]) -> None:
        from kvshard_router import epp

        self.epp = epp
        self.state = RouterState()
        self.state.reports = {p: WarmReport(1, (), f"http://10.0.{j >> 8}.{j & 255}:8100") for j, p in enumerate(pods)}
        self.endpoints = epp.Endpoints(self.state)
        self.pod_at = {epp.endpoint_of(r.url): p for p, r in self.state.reports.items()}
        self.policy = policy
        self.current: RouteRequest | None = None
        self.picker: Picker | None = None
        self.stream: Any = None
        self.choices: list[str | None] = []
        self.timings: list[tuple[int, int]] = []

    def _parse(self, raw: bytes) -> RouteRequest:
        assert self.current is not None
        return self.current

    def choose(self, request: RouteRequest, snapshot: Snapshot, load: LoadView) -> str | None:
        if self.picker is None or self.picker.load is not load:
            if not isinstance(load, Backlog):
                raise ValueError("the EPP front end decides with the router's Backlog (--load backlog)")
            self.picker = Picker(self.state, self.policy, load, RouterMetrics(self.state, load, cacheshard=""),
                                 parse=self._parse)
            self.picker.timings = self.timings
        self.state.snapshot, self.current = snapshot, request
        body = json.dumps({"user_id": request.user, "candidates": list(request.items)}).encode()
        self.stream = self.epp.ExtProcStream(self.picker, self.endpoints, account_load=False)
        answers = [a for m in self.epp.request_messages(body) for a in self.stream.handle(m)]
        endpoint = self.epp.destination(answers)
        pod = self.pod_at.get(endpoint) if endpoint is not None else None
        self.choices.append(pod)
        return pod

    def served(self, pod: str, request: RouteRequest, snapshot: Snapshot) -> None:
        self.stream.handle(self.epp.response_headers(200))
        self.stream.close()


class _Ids:
    """Lazy item ids ``item-0 … item-{n-1}`` (10 M Python strings would be ~700 MB)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return (f"item-{i}" for i in range(self.n))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the simulation and the decision-time measurement; print a table; write JSON/PNG if asked."""
    model = sim.ModelSettings(pods=args.pods, utilization=args.utilization, intervals=args.intervals)
    trace_settings = sim.TraceSettings(requests=args.requests, candidates=args.candidates, seed=args.seed)
    dataset = load_dataset("movielens-100k")
    vectors = None
    if args.embeddings == "minilm":
        from kvshard_operator.embedding import embed_catalog

        vectors = embed_catalog(list(dataset.items), [i.text for i in dataset.items.values()])
    trace = sim.build_trace(dataset, trace_settings, model, vectors)
    mean_full = float(np.mean([sim.service_ms(model, r.history_tokens, sum(r.item_tokens or ()))
                               for r in trace.requests]))
    lam = mean_full / (model.full_ms - model.cached_ms)
    rebalancing = RebalanceSettings(
        hot_percent=args.hot_percent,
        cold_percent=args.hot_percent // 2,
        imbalance_percent=115,
        settle_percent=105,
        move_budget=2 * args.pods if args.move_budget is None else args.move_budget,
        drop_budget=args.pods,
    )
    learning = sim.LearningSettings(move_budget=2 * args.pods)
    recent = sim.lru_blocks(trace, model) if args.recent_blocks is None else args.recent_blocks

    def affinity() -> RoutingPolicy:
        return make_policy("affinity", load_penalty_tokens=lam, recent_blocks_per_pod=recent)

    setups: dict[str, tuple[RoutingPolicy, RebalanceSettings | None, sim.LearningSettings | None]] = {
        "round-robin": (make_policy("round-robin"), None, None),
        "least-loaded": (make_policy("least-loaded"), None, None),
        "prefix-aware": (make_policy("prefix-aware"), None, None),
        "affinity": (_Recorded(affinity()), None, None),
        "affinity+rebalance": (affinity(), rebalancing, None),
        # no hot-cluster replication: only the co-request-learned swaps (issue 15)
        "affinity+learned": (affinity(), None, learning),
    }
    if args.oracle:
        setups["affinity+oracle"] = (affinity(), None, None)
    results: list[sim.Result] = []
    front_end: dict[int, str] = {}
    # the affinity row again, each request through the EPP front end's ext_proc messages (the EPP decides
    # with the router's Backlog, so only under --load backlog)
    through = _ThroughEpp(affinity(), tuple(f"pod-{j:03d}" for j in range(args.pods))) \
        if args.load == "backlog" else None
    runs = len(setups) + (through is not None)
    with tqdm(total=runs * len(trace.requests), desc="routing", unit="req", leave=False) as bar:
        for name, (policy, knobs, learns) in setups.items():
            bar.set_postfix_str(name)
            simulation = sim.Simulation(trace, model, knobs, learns, load=args.load)
            moved = simulation.place_in_hindsight(learning) if name == "affinity+oracle" else 0
            result = simulation.run(name, policy, bar.update)
            result.actions += moved
            results.append(result)
        if through is not None:
            bar.set_postfix_str("affinity (epp)")
            simulation = sim.Simulation(trace, model, None, None, load=args.load)
            results.append(simulation.run("affinity", through, bar.update))
            front_end[len(results) - 1] = "epp"
    timing = decision_time(args.items, args.decision_pods, args.candidates, seed=args.seed)
    direct = setups["affinity"][0]
    same_choices = through is not None and isinstance(direct, _Recorded) and direct.choices == through.choices

    windows = list(sim.windows_of(trace, model))
    burst_windows = [w for w, on in windows if on]
    settled = burst_windows[2:]
    rows: list[dict[str, Any]] = []
    for k, r in enumerate(results):
        end = front_end.get(k, "http")
        burst_imb = [r.window_imbalance[w] for w in settled if w < len(r.window_imbalance)]
        settle = next((w - burst_windows[0] for w in burst_windows if r.window_imbalance[w] <= TARGET_IMBALANCE), None)
        rows.append({
            "policy": r.policy,
            "hit_ratio": round(r.hit_ratio, 4),
            "imbalance": round(float(np.mean(r.window_imbalance)), 3),
            "p99_ms": round(r.p99_ms, 2),
            "burst_imbalance": round(max(burst_imb), 3) if burst_imb else None,
            "settle_intervals": settle,
            "rebalance_actions": r.actions,
            "front_end": end,
            "decision_p99_us": round(timing[end]["decision_p99_us"], 1),
            "decision_cpu_p99_us": round(timing[end]["decision_cpu_p99_us"], 1),
            "decision_p99_worst_round_us": round(timing[end]["decision_p99_worst_round_us"], 1),
            **({"message_p99_us": round(timing[end]["message_p99_us"], 1), "same_choices_as_http": same_choices}
               if end == "epp" else {}),
            "pods": args.pods,
            "requests": len(trace.requests),
            "load": args.load,
            "recent_blocks_per_pod": recent,
            "load_penalty_tokens": round(lam, 1),
        })
    _print(rows, timing, args, settled)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot is not None:
        _plot(results[:len(setups)], burst_windows, args.plot)  # the epp line would lie on the affinity one
    return rows


def _print(rows: list[dict[str, Any]], timing: dict[str, dict[str, float]], args: argparse.Namespace,
           settled: list[int]) -> None:
    print(f"{'policy':<20}{'front_end':>10}{'hit_ratio':>10}{'imbalance':>11}{'burst_imb':>11}{'settle':>8}"
          f"{'p99_ms':>10}{'actions':>9}")
    for row in rows:
        burst = "-" if row["burst_imbalance"] is None else f"{row['burst_imbalance']:.3f}"
        settle = "never" if row["settle_intervals"] is None else str(row["settle_intervals"])
        print(f"{row['policy']:<20}{row['front_end']:>10}{row['hit_ratio']:>10.3f}{row['imbalance']:>11.3f}{burst:>11}"
              f"{settle:>8}{row['p99_ms']:>10.1f}{row['rebalance_actions']:>9}")
    print(f"burst_imb: worst interval from two intervals after the burst starts to its end (windows {settled}); "
          f"settle: intervals from the burst's first until imbalance ≤ {TARGET_IMBALANCE}")
    epp = [row for row in rows if row["front_end"] == "epp"]
    if epp:
        print(f"the epp row replays the affinity row's trace through ext_proc messages: same choices as http: "
              f"{epp[0]['same_choices_as_http']}")
    for end, t in timing.items():
        message = (f"; ext_proc request phase end to end over loopback gRPC p50 {t['message_p50_us']:.0f} µs, "
                   f"p99 {t['message_p99_us']:.0f} µs") if "message_p99_us" in t else ""
        print(f"decision via {end} (affinity, {args.decision_pods} pods, {args.items:,} items, {args.candidates} "
              f"candidates): p50 {t['decision_p50_us']:.1f} µs, p99 {t['decision_p99_us']:.1f} µs wall "
              f"(median of rounds; worst round {t['decision_p99_worst_round_us']:.0f} µs, pooled "
              f"{t['decision_p99_pooled_us']:.0f} µs); CPU p50 {t['decision_cpu_p50_us']:.1f} µs, p99 "
              f"{t['decision_cpu_p99_us']:.1f} µs{message}")
    first = next(iter(timing.values()))
    print(f"snapshot {first['snapshot_mb']:.0f} MB, built in {first['snapshot_build_s']:.1f} s")


def _plot(results: list[sim.Result], burst_windows: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in results:
        top.plot(r.window_hit, marker=".", label=r.policy)
        bottom.plot(r.window_imbalance, marker=".", label=r.policy)
    for axis in (top, bottom):
        if burst_windows:
            axis.axvspan(burst_windows[0] - 0.5, burst_windows[-1] + 0.5, color="orange", alpha=0.15, label="burst")
        axis.grid(alpha=0.3)
    top.set_ylabel("item-block hit ratio")
    bottom.set_ylabel("imbalance (max/mean pod work)")
    bottom.axhline(1.25, color="grey", linestyle="--", linewidth=1)
    bottom.set_xlabel("rebalance interval")
    top.legend(fontsize=8, ncol=3)
    fig.suptitle("kvshard bench routing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
