"""What ``kvshard demo`` measured, as numbers, tables and a picture — pure functions over records.

The replay (``demo.py``) does the I/O and appends one :class:`Record` per request, one
:class:`PlacementSample` per poll of the placement and one :class:`PrefillPair` per request re-sent
with and without blending. Everything here turns those into the summary, so the arithmetic is tested
without a cluster:

* hit ratio per segment kind and tier (``memory``/``disk``/``peer`` as the sidecars report them,
  ``computed`` = the rest of the kind's query tokens);
* placement locality: the share of candidate items whose cluster the serving pod was assigned when
  the request was sent, for the pods the router chose and for the pods round-robin would have chosen
  on the same requests (``i mod healthy pods``) — a counterfactual computed from the same placement,
  not a second replay;
* TTFT p50/p99 of the replay, and of blended vs full prefill (``blend.method = full``) on the same
  requests sent one at a time to the same sidecar; agreement of the chosen candidate between the two
  (the answer is a ranking over the candidates, :mod:`kvshard.ranking`);
* recommendation quality — HR@1, HR@5, NDCG@10 of the rankings against the item the user actually
  rated next — of the replay, of blended and full prefill on the re-sent requests, and of a random
  ranking (its expectation), so "same as full prefill" and "useful at all" sit side by side; with
  retrieval-stage candidates (:mod:`kvshard.retrieval`), the served model beside the retrieval stage's
  own order and its recall — over every such request, a target the stage missed scoring 0 for both,
  and over those whose target it retrieved (:func:`retrieval_quality`);
* per-pod request share per phase with the max/mean imbalance, the generations seen and what each
  new generation changed;
* with a fidelity target, the guard's decisions over time (:mod:`demo_fidelity`);
* the autoscaling ramp's section (:mod:`demo_ramp`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvshard.ranking import QUALITY_METRICS, hit_at, ndcg_at, random_quality
from kvshard.retrieval import quality_or_miss
from kvshard_bench import demo_fidelity, demo_ramp

TIERS = ("memory", "disk", "peer")
KIND_ORDER = ("system", "history", "free", "item", "instruction")
PHASES = ("steady", "burst", "after")
PHASE_TITLES = {"steady": "before the burst", "burst": "burst, before rebalance", "after": "burst, after rebalance"}


@dataclasses.dataclass
class Record:
    """One request of the replay as the client saw it."""

    index: int
    phase: str
    sent_s: float
    latency_s: float
    status: int
    pod: str | None
    generation: int
    target: str
    trending: bool
    ttft_ms: float | None = None
    query: dict[str, int] = dataclasses.field(default_factory=dict)
    hit: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    label: str | None = None
    candidate: str | None = None
    target_rank: int | None = None
    """0-based position of the target in the answer's ranking (None: no ranking came back)."""
    num_candidates: int = 0
    held: float | None = None
    """Share of candidates whose cluster the serving pod was assigned (None: pod or placement unknown)."""
    rr_held: float | None = None
    """The same for the pod round-robin would have picked."""
    error: str = ""
    from_retrieval: bool = False
    """Whether the candidates were the retrieval stage's (the target among them only if it retrieved it)."""
    retrieval_rank: int | None = None
    """The target's 0-based position in the retrieval stage's order (None: not retrieved, or not from it)."""
    retrieval_weight: float | None = None
    """The stage's weight the sidecar fused with, as its reply says (None: no fusion)."""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclasses.dataclass(frozen=True)
class PlacementSample:
    """One poll: the generation and, per pod, clusters assigned and clusters reported warm."""

    t: float
    generation: int
    assigned: Mapping[str, int]
    warm: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class PrefillPair:
    """One request sent to the same sidecar blended (the sidecar's default) and with ratio 1 (full)."""

    index: int
    pod: str
    blended_ttft_ms: float
    full_ttft_ms: float
    blended_label: str | None
    full_label: str | None
    blended_rank: int | None = None
    """0-based position of the target in each answer's ranking."""
    full_rank: int | None = None
    num_candidates: int = 0


# ------------------------------------------------------------------------------------- arithmetic


def target_rank(answer: Mapping[str, Any], target: str) -> int | None:
    """Where ``target`` sits in a ``/v1/recommend`` answer's ``ranking`` (None: absent or no ranking)."""
    ranked = [entry.get("candidate") for entry in answer.get("ranking") or [] if isinstance(entry, Mapping)]
    return ranked.index(target) if target in ranked else None


def quality_of(ranks: Iterable[tuple[int | None, int]]) -> dict[str, float | int | None]:
    """Mean HR@1/HR@5/NDCG@10 over (target rank, candidates) pairs with a rank, beside the random
    expectation for the same candidate counts; ``requests`` counts the pairs used."""
    used = [(rank, count) for rank, count in ranks if rank is not None and count > 0]
    if not used:
        return {"requests": 0, **dict.fromkeys(QUALITY_METRICS), **{f"random_{m}": None for m in QUALITY_METRICS}}
    expected = [random_quality(count) for _, count in used]
    return {
        "requests": len(used),
        "hr1": sum(hit_at(rank, 1) for rank, _ in used) / len(used),
        "hr5": sum(hit_at(rank, 5) for rank, _ in used) / len(used),
        "ndcg10": sum(ndcg_at(rank, 10) for rank, _ in used) / len(used),
        **{f"random_{m}": sum(e[m] for e in expected) / len(expected) for m in QUALITY_METRICS},
    }


def retrieval_quality(records: Iterable[Record]) -> dict[str, Any] | None:
    """The served model's ranking and the retrieval stage's order on the successful requests whose
    candidates the stage chose: the stage's recall, and HR@1/HR@5/NDCG@10 of both — over all of them (a
    target the stage missed is not among the candidates and scores 0 for both) and over the retrieved
    ones — beside a random reranking's expectation. None when no request came from the stage."""
    used = [r for r in records if r.ok and r.from_retrieval]
    if not used:
        return None
    retrieved = [r for r in used if r.retrieval_rank is not None]

    def mean(ranks: Sequence[int | None], among: int) -> dict[str, float | None]:
        scored = [quality_or_miss(rank) for rank in ranks]
        return {m: sum(q[m] for q in scored) / among if among else None for m in QUALITY_METRICS}

    chance = [random_quality(r.num_candidates) for r in retrieved if r.num_candidates]
    random_retrieved = {m: sum(c[m] for c in chance) / len(chance) if chance else None for m in QUALITY_METRICS}
    share = len(retrieved) / len(used)
    return {
        "requests": len(used), "retrieved": len(retrieved), "recall": share,
        "weights": sorted({r.retrieval_weight for r in used if r.retrieval_weight is not None}),
        "served": {"all": mean([r.target_rank for r in used], len(used)),
                   "retrieved": mean([r.target_rank for r in retrieved], len(retrieved))},
        "retrieval_order": {"all": mean([r.retrieval_rank for r in used], len(used)),
                            "retrieved": mean([r.retrieval_rank for r in retrieved], len(retrieved))},
        "random": {"all": {m: None if v is None else v * share for m, v in random_retrieved.items()},
                   "retrieved": random_retrieved},
    }


def _weights(stage: Mapping[str, Any]) -> str:
    """``"2 × "`` for the stage's weight the sidecars fused with ("" for 1 or none reported; all of them,
    slash-separated, if pods served different models)."""
    weights = [float(w) for w in stage.get("weights", [])]
    return "" if weights in ([], [1.0]) else "/".join(f"{w:g}" for w in weights) + " × "


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def held_share(candidates: Sequence[str], item_clusters: Mapping[str, int], clusters: Iterable[int]) -> float:
    """Share of ``candidates`` whose cluster is in ``clusters`` (unknown items count as not held)."""
    if not candidates:
        return 0.0
    held = set(clusters)
    return sum(1 for c in candidates if item_clusters.get(c, -1) in held) / len(candidates)


def round_robin_pod(position: int, healthy: Sequence[str]) -> str | None:
    """The pod a round-robin router picks for the ``position``-th request (0-based) among ``healthy``."""
    return healthy[position % len(healthy)] if healthy else None


def hit_table(records: Iterable[Record]) -> dict[str, dict[str, int]]:
    """kind → {query, memory, disk, peer, computed} tokens over the successful requests."""
    table: dict[str, dict[str, int]] = {}
    for record in records:
        if not record.ok:
            continue
        for kind, tokens in record.query.items():
            row = table.setdefault(kind, {"query": 0, **dict.fromkeys(TIERS, 0), "computed": 0})
            row["query"] += tokens
            hits = record.hit.get(kind, {})
            served = 0
            for tier, count in hits.items():
                row[tier] = row.get(tier, 0) + count
                served += count
            row["computed"] += max(0, tokens - served)
    return dict(sorted(table.items(), key=lambda kv: _kind_rank(kv[0])))


def hit_ratio(row: Mapping[str, int]) -> float:
    """Tokens served from any tier over the kind's query tokens."""
    return sum(v for k, v in row.items() if k not in ("query", "computed")) / row["query"] if row["query"] else 0.0


def load_share(records: Iterable[Record], pods: Sequence[str]) -> dict[str, float]:
    """pod → share of the successful requests it served (every pod in ``pods`` listed)."""
    counts = dict.fromkeys(pods, 0)
    for record in records:
        if record.ok and record.pod is not None:
            counts[record.pod] = counts.get(record.pod, 0) + 1
    total = sum(counts.values())
    return {p: (c / total if total else 0.0) for p, c in sorted(counts.items())}


def imbalance(shares: Mapping[str, float]) -> float:
    """max / mean of the per-pod shares (1.0 = perfectly even)."""
    if not shares:
        return 1.0
    mean = sum(shares.values()) / len(shares)
    return max(shares.values()) / mean if mean else 1.0


def placement_changes(old: Mapping[int, Sequence[str]], new: Mapping[int, Sequence[str]]) -> list[str]:
    """What a new generation did, one line per changed cluster: ``cluster 3: +pod-1 -pod-0``."""
    lines = []
    for cluster in sorted(set(old) | set(new)):
        before, after = set(old.get(cluster, ())), set(new.get(cluster, ()))
        if before != after:
            parts = [f"+{p}" for p in sorted(after - before)] + [f"-{p}" for p in sorted(before - after)]
            lines.append(f"cluster {cluster}: {' '.join(parts)}")
    return lines


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _kind_rank(kind: str) -> tuple[int, str]:
    return (KIND_ORDER.index(kind), kind) if kind in KIND_ORDER else (len(KIND_ORDER), kind)


# ---------------------------------------------------------------------------------------- summary


def summarize(records: Sequence[Record], pairs: Sequence[PrefillPair], samples: Sequence[PlacementSample],
              changes: Mapping[int, Sequence[str]], pods: Sequence[str], wall_s: float,
              notes: Mapping[str, Any] | None = None, fidelity: Mapping[str, Any] | None = None,
              ramp: Mapping[str, Any] | None = None, pairs_failed: int = 0) -> dict[str, Any]:
    """Everything the demo prints, as one JSON-able document (``summary.json``); ``fidelity`` is
    :func:`demo_fidelity.summarize`'s section when the demo ran with a target, ``ramp``
    :func:`demo_ramp.section`'s (or ``{"outcome": why not}``) when it ran the autoscaling ramp;
    ``pairs_failed`` counts the requests re-sent for ``pairs`` that got no answer."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    blended = [p.blended_ttft_ms for p in pairs]
    full = [p.full_ttft_ms for p in pairs]
    b50, f50 = percentile(blended, 50), percentile(full, 50)
    b99, f99 = percentile(blended, 99), percentile(full, 99)
    phases: dict[str, Any] = {}
    for phase in PHASES:
        chosen = [r for r in records if r.phase == phase]
        shares = load_share(chosen, pods)
        phases[phase] = {"requests": len(chosen), "ok": sum(r.ok for r in chosen), "share": shares,
                         "imbalance": imbalance(shares), "held": _mean(r.held for r in chosen if r.ok),
                         "rr_held": _mean(r.rr_held for r in chosen if r.ok)}
    generations: dict[int, float] = {}
    for sample in samples:
        generations.setdefault(sample.generation, sample.t)
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok), "pairs_failed": pairs_failed,
        "wall_s": wall_s, "replay_s": max((r.sent_s + r.latency_s for r in records), default=0.0),
        "hits": hit_table(records),
        "placement_hit": {"router": _mean(r.held for r in ok), "round_robin": _mean(r.rr_held for r in ok)},
        "ttft_ms": {"replay_p50": percentile(ttft, 50), "replay_p99": percentile(ttft, 99),
                    "blended_p50": b50, "blended_p99": b99, "full_p50": f50, "full_p99": f99,
                    "speedup_p50": (f50 / b50) if b50 and f50 else None,
                    "speedup_p99": (f99 / b99) if b99 and f99 else None, "pairs": len(pairs)},
        "agreement": (sum(p.blended_label == p.full_label for p in pairs) / len(pairs)) if pairs else None,
        "quality": {"replay": quality_of((r.target_rank, r.num_candidates) for r in ok),
                    "blended": quality_of((p.blended_rank, p.num_candidates) for p in pairs),
                    "full": quality_of((p.full_rank, p.num_candidates) for p in pairs)},
        **({"retrieval": stage} if (stage := retrieval_quality(records)) is not None else {}),
        "phases": phases,
        "generations": {str(g): t for g, t in sorted(generations.items())},
        "changes": {str(g): list(lines) for g, lines in sorted(changes.items())},
        **({"fidelity": dict(fidelity)} if fidelity else {}),
        **({"ramp": dict(ramp)} if ramp else {}),
        **({"notes": dict(notes)} if notes else {}),
    }


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:  # first column left-aligned, numbers right-aligned
        return "  ".join(f"{c:<{w}}" if j == 0 else f"{c:>{w}}"
                         for j, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return [line(header), "  ".join("-" * w for w in widths), *(line(row) for row in rows)]


def render(summary: Mapping[str, Any]) -> str:
    """The summary as aligned plain-text tables (``summary.txt``, also printed)."""
    out = [f"requests {summary['requests']} ({summary['ok']} ok, {summary['errors']} failed), "
           f"replay {summary['replay_s']:.1f} s, wall time {summary['wall_s']:.1f} s", ""]
    rows = []
    hits: Mapping[str, Mapping[str, int]] = summary["hits"]
    for kind, row in hits.items():
        q = row["query"] or 1
        rows.append([kind, str(row["query"]), *(f"{row.get(t, 0) / q:.1%}" for t in (*TIERS, "computed")),
                     f"{hit_ratio(row):.1%}"])
    total = {"query": sum(r["query"] for r in hits.values())}
    for t in (*TIERS, "computed"):
        total[t] = sum(r.get(t, 0) for r in hits.values())
    if hits:
        rows.append(["all", str(total["query"]), *(f"{total[t] / (total['query'] or 1):.1%}"
                                                    for t in (*TIERS, "computed")), f"{hit_ratio(total):.1%}"])
    out += ["Hit ratio per segment kind and tier (share of the kind's prompt tokens)"]
    out += _table(["kind", "tokens", *TIERS, "computed", "hit ratio"], rows) + [""]
    ph = summary["placement_hit"]
    out += ["Item locality: share of candidates whose cluster the serving pod holds (same requests)"]
    out += _table(["router", "affinity (this run)", "round-robin (counterfactual)"],
                  [["share", _fmt(ph["router"], ".1%"), _fmt(ph["round_robin"], ".1%")]]) + [""]
    t = summary["ttft_ms"]
    lost = summary.get("pairs_failed") or 0
    out += [f"TTFT (ms): replay under load p50 {_fmt(t['replay_p50'])}  p99 {_fmt(t['replay_p99'])}; "
            f"same {t['pairs']} requests one at a time on the same sidecar"
            f"{f' ({lost} more re-sent got no answer)' if lost else ''}:"]
    out += _table(["", "p50", "p99"], [
        ["blended", _fmt(t["blended_p50"]), _fmt(t["blended_p99"])],
        ["full prefill", _fmt(t["full_p50"]), _fmt(t["full_p99"])],
        ["speed-up", _fmt(t["speedup_p50"], ".2f", "x"), _fmt(t["speedup_p99"], ".2f", "x")]]) + [""]
    out += [f"Agreement with full prefill (same chosen candidate): {_fmt(summary['agreement'], '.0%')}", ""]
    quality: Mapping[str, Mapping[str, Any]] = summary["quality"]
    out += ["Recommendation quality against the item the user rated next (random: a random ranking's expectation)"]
    rows = [[name, str(q["requests"]), *(_fmt(q[m], ".2f") for m in QUALITY_METRICS)]
            for name, q in (("replay (blended, under load)", quality["replay"]),
                            ("blended, re-sent", quality["blended"]), ("full prefill, re-sent", quality["full"]))]
    rows.append(["random", str(quality["replay"]["requests"]),
                 *(_fmt(quality["replay"][f"random_{m}"], ".2f") for m in QUALITY_METRICS)])
    out += _table(["ranking", "requests", "HR@1", "HR@5", "NDCG@10"], rows)
    stage: Mapping[str, Any] | None = summary.get("retrieval")
    if stage is not None:
        out += ["(rows above: requests whose target is among the candidates)", "",
                f"Retrieval-stage candidates: {stage['requests']} session requests, recall@K {stage['recall']:.0%} "
                f"({stage['retrieved']} targets retrieved); 'all' counts a missed target as 0 for every ranking"]
        rows = [[name, *(_fmt(stage[key][subset][m], ".2f") for subset in ("all", "retrieved")
                         for m in ("ndcg10", "hr1"))]
                for name, key in ((f"served: model + {_weights(stage)}retrieval score", "served"),
                                  ("retrieval order", "retrieval_order"), ("random", "random"))]
        out += _table(["ranking", "NDCG@10 (all)", "HR@1 (all)", "NDCG@10 (retrieved)", "HR@1 (retrieved)"], rows)
    out += [""]
    phases: Mapping[str, Mapping[str, Any]] = summary["phases"]
    pods = sorted({p for v in phases.values() for p in v["share"]})
    out += ["Per-pod request share per phase"]
    rows = [[PHASE_TITLES.get(name, name), str(v["requests"]), *(f"{v['share'].get(p, 0.0):.0%}" for p in pods),
             f"{v['imbalance']:.2f}", _fmt(v["held"], ".0%"), _fmt(v["rr_held"], ".0%")]
            for name, v in phases.items() if v["requests"]]
    out += _table(["phase", "requests", *pods, "max/mean", "held", "held (rr)"], rows) + [""]
    if "fidelity" in summary:
        out += demo_fidelity.render(summary["fidelity"])
    if "ramp" in summary:
        out += demo_ramp.render(summary["ramp"])
    gens = summary["generations"]
    out += ["Placement generations: " + (", ".join(f"{g} at {float(s):.0f} s" for g, s in gens.items()) or "none")]
    for g, lines in summary["changes"].items():
        out.append(f"  generation {g}: " + ("; ".join(lines) if lines else "no assignment change"))
    for key, value in summary.get("notes", {}).items():
        out.append(f"{key}: {value}")
    outcome = summary.get("verdict")
    if outcome is not None:
        reasons = outcome.get("reasons") or []
        out += ["", "Verdict: " + ("passed" if not reasons else f"FAILED (exit code {outcome.get('exit_code')})")]
        out += [f"  - {reason}" for reason in reasons]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- plot


def plot(records: Sequence[Record], samples: Sequence[PlacementSample], pods: Sequence[str], path: Path,
         bins: int = 30, fidelity: Sequence[demo_fidelity.FidelitySample] = (),
         target_percent: int | None = None) -> Path:
    """Two panels over time: requests per pod (load) and clusters assigned per pod (placement), with a
    vertical line at each new generation; with a fidelity target a third: the ratio in force and the
    measured agreement against the target. Written with matplotlib's Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max([r.sent_s + r.latency_s for r in records] + [1.0])
    samples = [s for s in samples if s.t <= end]  # polls after the replay (the prefill pairs) are not load
    width = end / bins
    guard = target_percent is not None
    fig, axes = plt.subplots(3 if guard else 2, 1, figsize=(12, 10 if guard else 7), sharex=True,
                             height_ratios=[1, 1, 0.9] if guard else None)
    load_ax, place_ax = axes[0], axes[1]
    centres = [(b + 0.5) * width for b in range(bins)]
    for j, pod in enumerate(pods):
        counts = [0] * bins
        for r in records:
            if r.ok and r.pod == pod:
                counts[min(bins - 1, int(r.sent_s / width))] += 1
        load_ax.plot(centres, [c / width for c in counts], marker=".", label=pod)
        if samples:  # a small vertical dodge keeps pods with equal counts visible
            dodge = (j - (len(pods) - 1) / 2) * 0.06
            place_ax.step([s.t for s in samples] + [end], [s.assigned.get(pod, 0) + dodge for s in samples]
                          + [samples[-1].assigned.get(pod, 0) + dodge], where="post", label=pod)
    for phase, colour in (("burst", "orange"), ("after", "green")):
        sent = [r.sent_s for r in records if r.phase == phase]
        if sent:
            load_ax.axvspan(min(sent), max(sent), color=colour, alpha=0.08, label=PHASE_TITLES[phase])
    last = None
    for s in samples:
        if last is not None and s.generation != last:
            for ax in axes:
                ax.axvline(s.t, color="grey", linestyle="--", linewidth=1)
            place_ax.annotate(f"gen {s.generation}", (s.t, 0), textcoords="offset points", xytext=(3, 3), fontsize=8)
        last = s.generation
    load_ax.set_xlim(0, end)
    load_ax.set_ylabel("requests / s")
    load_ax.set_title("Load: requests served per pod")
    load_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    place_ax.set_ylabel("clusters assigned")
    axes[-1].set_xlabel("seconds since the replay started")
    if target_percent is not None:
        demo_fidelity.plot_panel(axes[2], fidelity, target_percent, end)
    place_ax.set_title("Placement: item clusters per pod (dashed: new generation)")
    place_ax.set_ylim(bottom=0)
    place_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
