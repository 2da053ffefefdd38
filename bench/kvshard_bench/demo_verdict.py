"""Whether ``kvshard demo`` (``make demo``) passed: its exit code and why, from the summary's numbers.

Why a verdict at all: ``make demo`` is what CI and a reader run to see the system work, so its exit
code must say whether it did. Before issue 41 it said 0 while requests failed in the ramp, while
agreement with full prefill stayed below the fidelity guard's target, and when the ramp stopped short
(a failed ramp was a note in the summary). The demo fails (exit 1) when

* any request failed: of the replay, of the re-sent pairs (blended vs full prefill), of the ramp;
* no request was sent, or none answered;
* agreement with full prefill on the re-sent requests is below ``--fidelity-target`` (percent; 0: no
  target), or was never measured although pairs were asked for (``--pairs``);
* with the ramp on (``--ramp``, the default), the ramp did not run to completion.

Pure: the replay writes the summary (:func:`kvshard_bench.demo_report.summarize`), this reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

PASSED, FAILED = 0, 1


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The demo's exit code and the reasons it failed (none when it passed)."""

    code: int
    reasons: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """What the demo prints last."""
        if not self.reasons:
            return ["kvshard demo: passed (every request answered, the fidelity target and the ramp as asked)"]
        return [f"kvshard demo: FAILED ({len(self.reasons)} reason{'s' if len(self.reasons) > 1 else ''}):",
                *(f"  - {reason}" for reason in self.reasons)]

    def as_json(self) -> dict[str, Any]:
        return {"exit_code": self.code, "reasons": list(self.reasons)}


def verdict(summary: Mapping[str, Any], *, fidelity_target_percent: int = 0, ramp: bool = False,
            pairs_wanted: int = 0) -> Verdict:
    """The exit code of a demo run whose summary is ``summary`` (``summary.json``'s document):
    ``fidelity_target_percent`` is ``--fidelity-target`` (0: none), ``ramp`` whether the ramp was asked
    for, ``pairs_wanted`` ``--pairs`` (requests to re-send for the comparison with full prefill)."""
    reasons: list[str] = []
    requests, ok = int(summary.get("requests") or 0), int(summary.get("ok") or 0)
    if not requests:
        reasons.append("no request was sent")
    elif ok < requests:
        reasons.append(f"{requests - ok} of {requests} replay requests failed")
    pairs_failed = int(summary.get("pairs_failed") or 0)
    if pairs_failed:
        reasons.append(f"{pairs_failed} of the requests re-sent for the comparison with full prefill failed")
    if ramp:
        reasons += _ramp_reasons(summary.get("ramp"))
    if fidelity_target_percent:
        agreement = summary.get("agreement")
        if agreement is None:
            if pairs_wanted and ok:
                reasons.append(f"agreement with full prefill was not measured (no re-sent pair came back), so the "
                               f"{fidelity_target_percent} % target is not shown")
        elif float(agreement) < fidelity_target_percent / 100 - 1e-9:
            pairs = (summary.get("ttft_ms") or {}).get("pairs")
            on = f" on {pairs} re-sent requests" if pairs else ""
            reasons.append(f"agreement with full prefill {float(agreement):.1%}{on} is below the fidelity target "
                           f"{fidelity_target_percent} %")
    return Verdict(FAILED if reasons else PASSED, tuple(reasons))


def _ramp_reasons(section: Any) -> list[str]:
    if not isinstance(section, Mapping) or not section:
        return ["the autoscaling ramp did not run"]
    out = []
    failed = int(section.get("failed") or 0)
    if failed:
        out.append(f"{failed} of {section.get('requests', '?')} ramp requests failed")
    if section.get("completed") is not True:
        out.append(f"the autoscaling ramp did not complete: {section.get('outcome') or 'no outcome reported'}")
    return out
