"""The fidelity guard in ``kvshard demo``: the target the demo sets, and what the controller did over time.

Why in the demo: the guard is the one part of kvshard whose effect a user cannot see in a TTFT or a hit
ratio — it moves the recompute ratio in force while requests run. So the demo sets a target on its
CacheShard (``spec.fidelity``, :func:`fidelity_spec`) and shows, as a short table and a panel in the
PNG, each of the operator's decisions: when, the ratio in force, the shadow checks counted, the measured
agreement and ``FidelityMet``. The numbers come from the CacheShard's ``status.blend``,
``status.fidelity`` and conditions (what ``kubectl get cacheshard`` shows), polled by
:mod:`demo_watch` with the other conditions; everything here is pure, tested without a cluster.

The demo's defaults are sized to its length (a few minutes): a 20 s interval, a 60 s window and five
checks before the controller moves, 10 % of requests sampled — a production shard would use the CRD's
defaults (300 s, 600 s, 20 checks, 2 %).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

WINDOW_INTERVALS = 3
"""``windowSeconds`` as a multiple of ``intervalSeconds``: a decision counts the last three intervals."""
MIN_SAMPLES = 5
"""``minSamples`` of the demo's target: a few minutes at 10 % of ~1 request/s yield tens of checks."""


@dataclasses.dataclass(frozen=True)
class FidelitySample:
    """One poll of the CacheShard: the ratio in force and the controller's last measurement."""

    t: float
    ratio_percent: int | None
    samples: int | None = None
    agreement_percent: int | None = None
    lower_bound_percent: int | None = None
    met: str | None = None
    """``FidelityMet`` status: ``True``, ``False``, ``Unknown`` (None: no condition yet)."""
    reason: str | None = None
    decided_at: str | None = None
    """``status.fidelity.lastDecisionTime`` (None before the first decision)."""

    def state(self) -> tuple[Any, ...]:
        """Everything but the poll time: two polls with the same state show the same decision."""
        return dataclasses.astuple(self)[1:]


def fidelity_spec(target_percent: int, sample_rate_percent: int, interval_s: int) -> dict[str, Any]:
    """``spec.fidelity`` for the demo's CacheShard (the CRD's bounds: interval and window at least 10 s)."""
    if not 1 <= target_percent <= 100:
        raise ValueError(f"the fidelity target must be 1–100 %, got {target_percent}")
    if not 1 <= sample_rate_percent <= 100:
        raise ValueError(f"the fidelity sample rate must be 1–100 %, got {sample_rate_percent}")
    if interval_s < 10:
        raise ValueError(f"the fidelity interval must be at least 10 s (the CRD's minimum), got {interval_s}")
    return {"targetAgreementPercent": target_percent, "sampleRatePercent": sample_rate_percent,
            "intervalSeconds": interval_s, "windowSeconds": WINDOW_INTERVALS * interval_s,
            "minSamples": MIN_SAMPLES}


def sample_of(shard: Mapping[str, Any], t: float) -> FidelitySample | None:
    """The fidelity state of a CacheShard object at time ``t`` (None: no blend in force reported yet)."""
    status = shard.get("status") or {}
    blend, fidelity = status.get("blend") or {}, status.get("fidelity") or {}
    met: Mapping[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "FidelityMet"), {})
    if not blend and not fidelity and not met:
        return None

    def integer(value: Any) -> int | None:
        return None if value is None else int(value)

    return FidelitySample(t, integer(blend.get("ratioPercent")), integer(fidelity.get("samples")),
                          integer(fidelity.get("agreementPercent")), integer(fidelity.get("lowerBoundPercent")),
                          met.get("status"), met.get("reason"), fidelity.get("lastDecisionTime"))


def changes(samples: Sequence[FidelitySample]) -> list[FidelitySample]:
    """The polls whose state differs from the poll before (the first poll included): one per decision
    that changed anything, at the time the demo first saw it."""
    out: list[FidelitySample] = []
    for sample in samples:
        if not out or sample.state() != out[-1].state():
            out.append(sample)
    return out


def summarize(samples: Sequence[FidelitySample], spec: Mapping[str, Any]) -> dict[str, Any]:
    """The guard's part of ``summary.json``: the target, one row per change, the ratio at start and end
    and the ladder steps taken."""
    rows = changes(samples)
    ratios = [r.ratio_percent for r in rows if r.ratio_percent is not None]
    steps = sum(1 for a, b in zip(ratios, ratios[1:], strict=False) if a != b)
    last = rows[-1] if rows else None
    return {"spec": dict(spec), "rows": [dataclasses.asdict(r) for r in rows],
            "ratio_start_percent": ratios[0] if ratios else None,
            "ratio_end_percent": ratios[-1] if ratios else None, "steps": steps,
            "decisions": len({r.decided_at for r in rows if r.decided_at}),
            "fidelity_met": None if last is None else f"{last.met} ({last.reason})" if last.met else None}


def render(section: Mapping[str, Any]) -> list[str]:
    """The summary's fidelity table (``time  ratio  samples  agreement  FidelityMet``) as text lines."""
    spec = section["spec"]
    out = [f"Fidelity guard: target {spec['targetAgreementPercent']} % agreement with full prefill, "
           f"{spec['sampleRatePercent']} % of requests shadow-checked, a decision every "
           f"{spec['intervalSeconds']} s over {spec['windowSeconds']} s (at least {spec['minSamples']} checks)"]
    rows = section["rows"]
    if not rows:
        return [*out, "  the CacheShard reported no blend in force during the replay", ""]

    def pct(value: int | None) -> str:
        return "—" if value is None else f"{value}%"

    table = [["time", "ratio", "samples", "agreement", "lower bound", "FidelityMet"]]
    for row in rows:
        met = "—" if row["met"] is None else f"{row['met']} ({row['reason']})" if row["reason"] else row["met"]
        table.append([f"{row['t']:.0f} s", pct(row["ratio_percent"]),
                      "—" if row["samples"] is None else str(row["samples"]), pct(row["agreement_percent"]),
                      pct(row["lower_bound_percent"]), met])
    widths = [max(len(line[j]) for line in table) for j in range(len(table[0]))]
    for index, line in enumerate(table):
        out.append("  ".join(cell.ljust(w) if j in (0, 5) else cell.rjust(w)
                             for j, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    out.append(f"ratio in force {pct(section['ratio_start_percent'])} → {pct(section['ratio_end_percent'])} "
               f"({section['steps']} ladder steps, {section['decisions']} decisions seen)")
    return [*out, ""]


def plot_panel(ax: Any, samples: Sequence[FidelitySample], target_percent: int, end: float) -> None:
    """Ratio in force (step line) and measured agreement (points at each decision) against the target."""
    rows = [s for s in changes(samples) if s.t <= end]
    if rows:
        ax.step([s.t for s in rows] + [end], [s.ratio_percent or 0 for s in rows] + [rows[-1].ratio_percent or 0],
                where="post", color="tab:purple", label="recompute ratio in force (%)")
    measured = [s for s in rows if s.agreement_percent is not None]
    ax.plot([s.t for s in measured], [s.agreement_percent for s in measured], "o-", color="tab:green",
            label="measured agreement (%)")
    ax.axhline(target_percent, color="tab:red", linestyle=":", linewidth=1.2, label=f"target {target_percent} %")
    ax.set_ylim(-2, 105)
    ax.set_ylabel("percent")
    ax.set_title("Fidelity guard: agreement with full prefill and the ratio the controller keeps in force")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
