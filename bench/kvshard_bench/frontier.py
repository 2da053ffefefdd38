"""``kvshard bench fidelity --sweep``: the fidelity/speed frontier of every blend method.

Every method (the engine's selectors, the published baselines ``cacheblend`` and ``epic``, and the
selectors with each training-free correction) runs at every ratio; each row carries KL, τ, top-1
(the chosen candidate), TTFT and the speed-ups vs full prefill and vs prefix reuse. One PNG shows two
panels — KL vs speed-up and top-1 vs speed-up — one line per method, with ``prefix`` as a point: a
method is worth serving only where its line sits left-of-nothing, i.e. faster than ``prefix`` at the
same fidelity. ``--history``/``--candidates`` with several values repeat the sweep per prompt size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvshard_bench.tables import format_rows

Row = dict[str, Any]
SWEEP_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
SWEEP_METHODS = (
    "none", "boundary", "deviation", "hybrid", "tail", "cacheblend", "epic",
    "boundary+structure", "deviation+structure", "tail+structure", "boundary+labels", "tail+labels",
    "deviation+segment", "tail+segment",
    "boundary+tail", "deviation+tail", "deviation+tail+structure",
    "none+ape", "tail+ape", "deviation+ape",
)
RATIO_FREE = ("none", "none+ape")  # recompute only the question whatever the ratio: one row


def sweep_specs(methods: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, float]]:
    """(method, ratio) pairs of a sweep; ratio-free methods once at r = 0."""
    pairs: list[tuple[str, float]] = []
    for method in methods:
        if method in RATIO_FREE:
            pairs.append((method, 0.0))
        else:
            pairs += [(method, float(r)) for r in ratios]
    return pairs


def format_sweep(rows: Sequence[Row]) -> str:
    """The sweep's rows, one line each, grouped by prompt size then method."""
    columns = ["history", "candidates", "method", "ratio", "ttft_ms", "speedup_vs_full", "speedup_vs_prefix",
               "ideal_speedup", "kl", "label_kl", "tau", "top1_agreement", "recompute_ratio"]
    headers = ["H", "K", "method", "r", "ttft_ms", "x_full", "x_prefix", "ideal", "kl", "label_kl", "tau",
               "cand_top1", "recomp"]
    return format_rows(headers, columns, [r for r in rows if r.get("kl") is not None])


def plot_frontier(rows: Sequence[Row], path: Path) -> None:
    """Two panels (KL vs speed-up, top-1 vs speed-up), one line per method, per prompt size the first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({(r.get("history"), r.get("candidates")) for r in rows})
    first = sizes[0] if sizes else (None, None)
    chosen = [r for r in rows if (r.get("history"), r.get("candidates")) == first and r.get("kl") is not None]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    by_method: dict[str, list[Row]] = {}
    for row in chosen:
        by_method.setdefault(row["method"], []).append(row)
    cmap = plt.get_cmap("tab20")
    for index, (method, points) in enumerate(sorted(by_method.items())):
        points.sort(key=lambda r: r["speedup_vs_full"])
        xs = [p["speedup_vs_full"] for p in points]
        style = {"marker": "s" if method in ("full", "prefix") else "o", "color": cmap(index % 20),
                 "linestyle": "--" if "+" in method else "-", "label": method}
        left.plot(xs, [p["kl"] for p in points], **style)
        right.plot(xs, [p["top1_agreement"] for p in points], **style)
    for axes, label in ((left, "KL(full ‖ method), nats"), (right, "top-1 candidate agreement with full")):
        axes.set_xscale("log")
        axes.set_xlabel("speed-up vs full prefill (median TTFT, blocks cached; log)")
        axes.set_ylabel(label)
        axes.grid(True, which="both", alpha=0.3)
    left.set_ylim(bottom=-0.02)
    right.set_ylim(-0.02, 1.02)
    right.legend(fontsize=7, loc="lower left", ncol=2)
    history, candidates = first
    figure.suptitle(f"kvshard blend frontier (history {history}, {candidates} candidates)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
