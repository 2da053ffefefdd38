"""The pure parts of ``kvshard bench load`` (:mod:`kvshard_bench.load`): percentiles, answers compared
with full prefill, the RSS of a process tree, a closed-loop client, the rows, the table and the plot.

Nothing here starts a server, so the unit tests exercise it without one.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Row = dict[str, Any]
Scores = dict[str, float]
"""Candidate id → its label-restricted log-probability (the sidecar's ``ranking[].logprob``)."""

MODES = ("kvshard_vllm", "kvshard_embedded", "vllm_apc")
ROW_KEYS = ("mode", "model", "in_flight", "ttft_p50_ms", "ttft_p99_ms", "recs_per_s", "tokens_computed",
            "sidecar_rss_mb", "vllm_rss_mb", "agreement", "max_score_diff")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default); ``nan`` for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def top1(scores: Mapping[str, float]) -> str:
    """The chosen candidate: the highest score, the first one (in the mapping's order) on a tie."""
    if not scores:
        raise ValueError("no candidates")
    return max(scores, key=lambda c: scores[c])


def compare(answers: Sequence[Scores], references: Sequence[Scores]) -> tuple[float, float]:
    """``(agreement, max_score_diff)`` of ``answers`` against full prefill's ``references``, request by
    request: the share whose top-1 candidate is the reference's, and the largest |score − reference score|
    over every candidate. Both must score the same candidates."""
    if len(answers) != len(references):
        raise ValueError(f"{len(answers)} answers but {len(references)} references")
    if not answers:
        return math.nan, math.nan
    agree, worst = 0, 0.0
    for answer, reference in zip(answers, references, strict=True):
        if set(answer) != set(reference):
            raise ValueError(f"the answer scores {sorted(answer)} but the reference {sorted(reference)}")
        agree += top1(answer) == top1(reference)
        worst = max(worst, *(abs(answer[c] - reference[c]) for c in reference))
    return agree / len(answers), worst


def hit_rate_at_1(answers: Sequence[Scores], targets: Sequence[str | None]) -> float:
    """HR@1: the share of requests whose chosen candidate is the request's held-out item."""
    if not answers:
        return math.nan
    return sum(top1(a) == t for a, t in zip(answers, targets, strict=True)) / len(answers)


# ------------------------------------------------------------------------------------------ processes


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant alive now (vLLM's API server spawns an engine core and a worker)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_pid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, []))
    return tree


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid``'s whole process tree in MB (MiB; 0 for processes gone)."""
    total_kib = 0
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total_kib / 1024


class RssPeak:
    """Samples the RSS of process trees in a thread while a level runs; :attr:`peak_mb` per name."""

    def __init__(self, pids: Mapping[str, int], interval_s: float = 0.5) -> None:
        self.pids, self.interval = dict(pids), interval_s
        self.peak_mb = {name: 0.0 for name in self.pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            self.peak_mb[name] = max(self.peak_mb[name], rss_mb(pid))

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssPeak:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ------------------------------------------------------------------------------------------ load


@dataclass(frozen=True)
class Answer:
    """One recommendation as the client saw it: latency of the rank request, the candidates' scores, and
    the tokens computed for it (``None`` where the answer does not say: vLLM's counter tells instead)."""

    latency_s: float
    scores: Scores
    tokens_computed: int | None = None


@dataclass
class LevelResult:
    """One concurrency level: the answers in trace order and the level's wall time."""

    in_flight: int
    answers: list[Answer]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def recs_per_s(self) -> float:
        return len(self.answers) / self.wall_s if self.wall_s > 0 else math.nan


def closed_loop(requests: Sequence[Any], in_flight: int, ask: Callable[[Any], Answer],
                progress: Callable[[], None] = lambda: None) -> LevelResult:
    """``in_flight`` client threads pull the requests in order, each sending its next one when its last
    one is answered; the level's time runs from the first send to the last answer. An error in any
    request is raised here (after the other threads finished what they held)."""
    work: queue.Queue[int] = queue.Queue()
    for index in range(len(requests)):
        work.put(index)
    answers: list[Answer | None] = [None] * len(requests)
    errors: list[BaseException] = []

    def client() -> None:
        while not errors:
            try:
                index = work.get_nowait()
            except queue.Empty:
                return
            try:
                answers[index] = ask(requests[index])
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                errors.append(error)
                return
            progress()

    threads = [threading.Thread(target=client, name=f"load-client-{i}") for i in range(max(1, in_flight))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return LevelResult(in_flight, [a for a in answers if a is not None], wall)


def build_row(mode: str, model: str, level: LevelResult, references: Sequence[Scores],
              targets: Sequence[str | None], sidecar_rss_mb: float | None, vllm_rss_mb: float | None,
              tokens_computed: float | None = None) -> Row:
    """One row of the bench (mode × in_flight) with :data:`ROW_KEYS` and ``hr1``, ``requests`` and the
    level's extras. ``tokens_computed`` per request: given (vLLM's counter), else the answers' mean."""
    latencies = [a.latency_s * 1000 for a in level.answers]
    if tokens_computed is None:
        counted = [a.tokens_computed for a in level.answers if a.tokens_computed is not None]
        tokens_computed = sum(counted) / len(counted) if counted else None
    agreement, worst = compare([a.scores for a in level.answers], references)
    return {"mode": mode, "model": model, "in_flight": level.in_flight,
            "ttft_p50_ms": round(percentile(latencies, 50), 1), "ttft_p99_ms": round(percentile(latencies, 99), 1),
            "recs_per_s": round(level.recs_per_s, 3),
            "tokens_computed": None if tokens_computed is None else round(tokens_computed, 1),
            "sidecar_rss_mb": None if sidecar_rss_mb is None else round(sidecar_rss_mb),
            "vllm_rss_mb": None if vllm_rss_mb is None else round(vllm_rss_mb),
            "agreement": round(agreement, 3), "max_score_diff": float(f"{worst:.3g}"),
            "hr1": round(hit_rate_at_1([a.scores for a in level.answers], targets), 3),
            "requests": len(level.answers), **level.extra}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 2)


def ratios(rows: Iterable[Row]) -> list[Row]:
    """Per in_flight: kvshard_vllm's recs/s over kvshard_embedded's and vllm_apc's, and its p99 TTFT over
    theirs (``None`` where a mode did not run)."""
    by = {(r["mode"], r["in_flight"]): r for r in rows}
    out = []
    for level in sorted({n for _, n in by}):
        ours = by.get(("kvshard_vllm", level))
        if ours is None:
            continue
        row: Row = {"in_flight": level}
        for other, short in (("kvshard_embedded", "embedded"), ("vllm_apc", "vllm_apc")):
            theirs: Row = by.get((other, level)) or {}
            row[f"recs_per_s_vs_{short}"] = _ratio(ours["recs_per_s"], theirs.get("recs_per_s"))
            row[f"p99_vs_{short}"] = _ratio(ours["ttft_p99_ms"], theirs.get("ttft_p99_ms"))
        out.append(row)
    return out


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def format_table(rows: Sequence[Row], columns: Sequence[str]) -> str:
    """Rows as a fixed-width text table of ``columns`` (None as ``-``)."""
    widths = [max(len(c), *(len(_cell(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(_cell(r.get(c)).rjust(w) for c, w in zip(columns, widths, strict=True)) for r in rows]
    return "\n".join(lines)


TABLE_COLUMNS = ("mode", "in_flight", "ttft_p50_ms", "ttft_p99_ms", "recs_per_s", "tokens_computed",
                 "sidecar_rss_mb", "vllm_rss_mb", "agreement", "max_score_diff", "hr1")
RATIO_COLUMNS = ("in_flight", "recs_per_s_vs_embedded", "recs_per_s_vs_vllm_apc", "p99_vs_embedded", "p99_vs_vllm_apc")


def plot(rows: Sequence[Row], path: Path) -> None:
    """Throughput and p99 TTFT against in_flight, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: int(r["in_flight"]))
        if not mine:
            continue
        label = f"{mode} (HR@1 {overall_hr1(mine):.3f}, agreement {min(r['agreement'] for r in mine)})"
        levels = [r["in_flight"] for r in mine]
        left.plot(levels, [r["recs_per_s"] for r in mine], marker="o", label=label)
        right.plot(levels, [r["ttft_p99_ms"] for r in mine], marker="o", label=mode)
    for axis, title, unit in ((left, "throughput", "recommendations / s"), (right, "p99 latency", "p99 TTFT (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("recommendations in flight")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle("kvshard bench load: late scorer through kvshard vs isolated scorer on plain vLLM")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def overall_hr1(rows: Sequence[Row]) -> float:
    """HR@1 over every request of ``rows`` (one mode's levels), each level weighted by its requests."""
    return sum(float(r["hr1"]) * int(r["requests"]) for r in rows) / max(1, sum(int(r["requests"]) for r in rows))
