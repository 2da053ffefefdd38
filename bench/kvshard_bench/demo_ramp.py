"""``kvshard demo``'s last phase: a load ramp the chart's autoscaler answers with a pod, and then without it.

Why in the demo: the autoscaler is the one part whose effect shows only over time — pods come and go
while requests run, and what a user wants to see is that nothing failed, that the new pod served warm
and how long that took, how many clusters moved, and what it did to hit ratio and locality. The phase
scales the cluster to the autoscaling rules' minimum (two pods with the local rules), starts the
cluster's autoscaler (:class:`~kvshard_local.scaling.LocalAutoscaler`, the chart's KEDA query and HPA
rule) and drives :class:`~kvshard_local.ramp.LoadRamp` with MovieLens session requests from the
demo's trace; the load levels come from the pressure target (:func:`~kvshard_local.ramp.plan_ramp`).

Here: running the phase, the document it writes (``ramp.json``: the timeline, decisions, segments,
evaluations and every request), the summary's section of it (text and ``summary.json``) and the
picture (``ramp.png``: pods, load per pod, pressure, hit ratio and locality over time, decisions
marked). A ramp that times out is reported as such, and the demo's other results stand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvshard_local.ramp import RampResult
from kvshard_local.ramp_timeline import STATES, summarize

TIMELINE_ROWS = 24
"""The summary's timeline shows about this many rows (ramp.json has every sample)."""
STATE_COLOURS = {"serving": "tab:green", "warming": "tab:orange", "draining": "tab:red"}


def run(cluster: Any, make_body: Callable[[], Mapping[str, Any]], timeout_s: float,
        progress: Callable[[str], None] = print, sample_every_s: float = 1.0) -> RampResult | str:
    """The ramp on a running local cluster (its own autoscaler if it runs one, else the local rules'
    for the ramp's length); a string says why it could not start."""
    from kvshard_local.ramp import LoadRamp, plan_ramp
    from kvshard_local.scaling import LocalAutoscaler, local_rules

    autoscaler = cluster.autoscaler or LocalAutoscaler(cluster, local_rules(cluster.settings))
    rules = autoscaler.rules
    try:
        plan = plan_ramp(rules, autoscaler.period)
    except ValueError as exc:
        return f"no ramp: {exc}"
    pods = len(cluster.pod_names)
    if pods != rules.min_replicas:
        progress(f"autoscaling ramp: scaling {pods} → {rules.min_replicas} pods first (the rules' minimum), "
                 "then waiting for the placement to settle")
        cluster.scale(rules.min_replicas)
        try:
            cluster.wait_ready(timeout=timeout_s, progress=lambda line: None)
        except TimeoutError as exc:
            return f"no ramp: the cluster did not settle on {rules.min_replicas} pods: {exc}"
    progress(f"autoscaling ramp: {rules.min_replicas}–{rules.max_replicas} pods, target pressure {rules.target:g} "
             f"per pod, query evaluated every {autoscaler.period:g} s: {autoscaler.query}")
    own = cluster.autoscaler is None
    if own:
        autoscaler.start()
    try:
        return LoadRamp(cluster, autoscaler, plan, make_body, timeout_s=timeout_s, sample_every_s=sample_every_s,
                        progress=progress).run()
    finally:
        if own:
            autoscaler.stop()


def document(result: RampResult) -> dict[str, Any]:
    """Everything the ramp recorded and what it means (``ramp.json``)."""
    rules = result.rules
    return {
        "outcome": result.outcome, "completed": result.completed, "duration_s": result.end,
        "rules": dataclasses.asdict(rules), "query": result.query, "plan": dataclasses.asdict(result.plan),
        **summarize(result.requests, result.samples, result.changes, result.placements, result.end),
        "evaluations": result.evaluations,
        "requests_log": [dataclasses.asdict(r) for r in result.requests],
    }


def section(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The summary's part of the document: no per-request log, the timeline thinned for the text."""
    keep = {k: v for k, v in doc.items() if k not in ("requests_log", "evaluations", "timeline")}
    timeline = list(doc.get("timeline", []))
    stride = max(1, -(-len(timeline) // TIMELINE_ROWS))
    keep["timeline"] = timeline[::stride] + (timeline[-1:] if timeline and (len(timeline) - 1) % stride else [])
    return keep


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _table(rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Aligned text: the first ``left`` columns left-aligned, the rest right-aligned; a rule under the header."""
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    out = []
    for index, row in enumerate(rows):
        out.append("  ".join(c.ljust(w) if j < left else c.rjust(w)
                             for j, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def render(ramp: Mapping[str, Any]) -> list[str]:
    """The summary's autoscaling section as text lines (``ramp``: :func:`section`, or a note string)."""
    if isinstance(ramp, str) or "rules" not in ramp:
        return ["Autoscaling load ramp", f"  {ramp if isinstance(ramp, str) else ramp.get('outcome')}", ""]
    rules, plan = ramp["rules"], ramp["plan"]
    out = [f"Autoscaling load ramp: {rules['min_replicas']}–{rules['max_replicas']} pods, target pressure "
           f"{rules['target']:g} per pod, query {ramp['query']}",
           f"requests in flight: rise {' → '.join(map(str, plan['rise']))}, fall {' → '.join(map(str, plan['fall']))} "
           f"(a rising level {plan['dwell_s']:.0f} s, a falling one {plan['fall_dwell_s']:.0f} s); "
           f"{ramp['requests']} requests, {ramp['failed']} failed; {ramp['duration_s']:.0f} s",
           f"outcome: {ramp['outcome']}"]
    rows = [["decision", "at", "pods", "pressure", "running", "warm", "1st answer", "settled", "moved", "≤ 1.1/N"]]
    for d in ramp["decisions"]:
        moved = d["moved_fraction"]
        rows.append(["scale-out" if d["to"] > d["from"] else "scale-in", f"{d['t']:.0f} s", f"{d['from']}→{d['to']}",
                     _fmt(d["pressure"], ".2f"), _fmt(d["running_s"], ".1f", " s"), _fmt(d["warm_s"], ".1f", " s"),
                     _fmt(d["serving_s"], ".1f", " s"), _fmt(d["settled_s"], ".1f", " s"), _fmt(moved, ".3f"),
                     "—" if moved is None else f"{d['bound']:.3f} {'yes' if d['within_bound'] else 'NO'}"])
    if len(rows) > 1:
        out += ["Scale decisions (times from the decision: pods running, new pod warm and routable, its first "
                "answer, placement settled with every pod serving)"] + _table(rows)
        for d in ramp["decisions"]:
            for pod, answer in d["drains"].items():
                out.append(f"  drain of {pod}: {'drained' if answer.get('drained') else 'NOT drained'}"
                           f"{_detail(answer)}")
    else:
        out.append("no scale decision during the ramp")
    rows = [["segment", "from", "to", "requests", "failed", "req/s", "hit ratio", "locality"]]
    for s in ramp["segments"]:
        rows.append([s["segment"], f"{s['from']:.0f} s", f"{s['to']:.0f} s", str(s["requests"]), str(s["failed"]),
                     _fmt(s["per_s"], ".2f"), _fmt(s["hit_ratio"], ".1%"), _fmt(s["locality"], ".1%")])
    out += ["", "Per segment (requests by send time; hit ratio: prompt tokens from any tier; locality: candidates "
            "whose cluster the serving pod holds)"] + _table(rows)
    head = ramp["hit_ratio"]

    def part(name: str, key: str) -> str:
        return _fmt(head[name][key], ".1%") if head.get(name) else "—"

    out.append(f"hit ratio before / during / after the changes: {part('before', 'hit_ratio')} / "
               f"{part('during', 'hit_ratio')} / {part('after', 'hit_ratio')}; locality "
               f"{part('before', 'locality')} / {part('during', 'locality')} / {part('after', 'locality')}")
    rows = [["t", "phase", "in flight", *STATES, "req/s per pod", "pressure", "hit ratio", "locality"]]
    for row in ramp["timeline"]:
        served = " ".join(f"{p.rsplit('-', 1)[-1]}:{v:.2f}" for p, v in sorted(row["served_per_s"].items()))
        rows.append([f"{row['t']:.0f} s", row["phase"], str(row["level"]),
                     *(",".join(p.rsplit("-", 1)[-1] for p in row["pods"][state]) or "-" for state in STATES),
                     served or "-", f"{row['pressure_sum']:.2f}", _fmt(row["hit_ratio"], ".0%"),
                     _fmt(row["locality"], ".0%")])
    if len(rows) > 1:
        out += ["", "Timeline (pods by ordinal; load and ratios over the last 10 s; pressure: the query's sum)"]
        out += _table(rows, left=2)
    return [*out, ""]


def _detail(answer: Mapping[str, Any]) -> str:
    parts = [f"{answer['seconds']:.1f} s" if isinstance(answer.get("seconds"), int | float) else "",
             f"{answer['served_while_draining']} served while draining" if "served_while_draining" in answer else "",
             str(answer.get("error", ""))]
    text = ", ".join(p for p in parts if p)
    return f" ({text})" if text else ""


def plot(doc: Mapping[str, Any], path: Path) -> Path:
    """Four panels over the ramp: pods by state, requests per second per pod (and offered), each pod's
    pressure term and their sum against the thresholds, hit ratio and locality; a vertical line at each
    scale decision, shaded until it settled. matplotlib's Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["timeline"]
    fig, axes = plt.subplots(4, 1, figsize=(12, 12), sharex=True)
    pods_ax, load_ax, pressure_ax, hit_ax = axes
    t = [r["t"] for r in rows]
    bottom = [0.0] * len(rows)
    for state in STATES:
        counts = [len(r["pods"][state]) for r in rows]
        pods_ax.fill_between(t, bottom, [b + c for b, c in zip(bottom, counts, strict=True)], step="post",
                             color=STATE_COLOURS[state], alpha=0.6, label=state)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    level_ax = pods_ax.twinx()
    level_ax.step(t, [r["level"] for r in rows], where="post", color="black", linestyle="--",
                  label="requests in flight")
    level_ax.set_ylabel("requests in flight")
    level_ax.set_ylim(bottom=0)
    pods_ax.set_ylabel("pods")
    pods_ax.set_ylim(0, doc["rules"]["max_replicas"] + 0.5)
    pods_ax.set_title("Pods by state (dashed: requests the ramp keeps in flight)")
    pods = sorted({p for r in rows for p in r["served_per_s"]} | {p for r in rows for p in r["pressure"]})
    for pod in pods:
        load_ax.plot(t, [r["served_per_s"].get(pod) for r in rows], label=pod)
        pressure_ax.plot(t, [r["pressure"].get(pod) for r in rows], label=pod)
    load_ax.plot(t, [r["offered_per_s"] for r in rows], color="black", linestyle="--", label="offered (sent)")
    load_ax.set_ylabel("requests / s")
    load_ax.set_title("Load per pod: requests answered per second (last 10 s)")
    pressure_ax.plot(t, [r["pressure_sum"] for r in rows], color="black", label="sum (the autoscaler's query)")
    target, low, high = doc["rules"]["target"], doc["rules"]["min_replicas"], doc["rules"]["max_replicas"]
    for n in range(low, high + 1):
        pressure_ax.axhline(n * target, color="grey", linestyle=":", linewidth=1)
        pressure_ax.annotate(f"{n} × target", (0, n * target), textcoords="offset points", xytext=(2, 2), fontsize=7)
    pressure_ax.set_ylabel("pressure")
    pressure_ax.set_ylim(bottom=0)
    pressure_ax.set_title("Pressure per pod (averaged over the query's window) and its sum")
    hit_ax.plot(t, [r["hit_ratio"] for r in rows], color="tab:blue", label="hit ratio (prompt tokens)")
    hit_ax.plot(t, [r["locality"] for r in rows], color="tab:purple", label="locality (candidates held)")
    hit_ax.set_ylim(-0.02, 1.02)
    hit_ax.set_ylabel("share")
    hit_ax.set_title("Hit ratio and locality of the requests answered in the last 10 s")
    hit_ax.set_xlabel("seconds since the ramp started")
    for d in doc["decisions"]:
        colour = "tab:red" if d["to"] > d["from"] else "tab:blue"
        for ax in axes:
            ax.axvline(d["t"], color=colour, linewidth=1.2)
            if d["settled_s"] is not None:
                ax.axvspan(d["t"], d["t"] + d["settled_s"], color=colour, alpha=0.07)
        pods_ax.annotate(f"{d['from']}→{d['to']}", (d["t"], 0.1), textcoords="offset points", xytext=(3, 3),
                         fontsize=8, color=colour)
    for ax in (pods_ax, load_ax, pressure_ax, hit_ax):
        ax.legend(loc="upper left", bbox_to_anchor=(1.06 if ax is pods_ax else 1.01, 1.0), fontsize=8)
    level_ax.legend(loc="lower left", bbox_to_anchor=(1.06, 0.0), fontsize=8)
    axes[-1].set_xlim(0, max([doc["duration_s"], *t, 1.0]))
    fig.suptitle(f"Autoscaling load ramp — {doc['outcome']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
