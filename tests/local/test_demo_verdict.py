"""``kvshard demo``'s exit code (issue 41): non-zero when any request failed, when agreement with full
prefill is below the fidelity target, or when the ramp did not complete — decided by a pure function of
the summary's numbers, so it is tested without a 10-minute demo run.

Before the fix the demo returned 0 for a ramp that raised or timed out (a note in the summary) and for
any agreement whatever the target; the summary documents below are shaped as ``summary.json`` is.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvshard_bench import demo_report as rep
from kvshard_bench.demo_verdict import FAILED, PASSED, Verdict, verdict

RAMP_OK = {"outcome": "complete", "completed": True, "requests": 400, "failed": 0}


def summary(requests: int = 160, ok: int = 160, agreement: float | None = 1.0, pairs: int = 20,
            ramp: Any = None, pairs_failed: int = 0) -> dict[str, Any]:
    """The numbers the verdict reads, as :func:`demo_report.summarize` writes them."""
    out: dict[str, Any] = {"requests": requests, "ok": ok, "errors": requests - ok, "agreement": agreement,
                           "ttft_ms": {"pairs": pairs}, "pairs_failed": pairs_failed}
    if ramp is not None:
        out["ramp"] = ramp
    return out


def decide(doc: dict[str, Any], target: int = 90, ramp: bool = True, pairs: int = 20) -> Verdict:
    return verdict(doc, fidelity_target_percent=target, ramp=ramp, pairs_wanted=pairs)


def test_a_clean_run_passes() -> None:
    outcome = decide(summary(ramp=RAMP_OK))
    assert (outcome.code, outcome.reasons) == (PASSED, ())
    assert outcome.lines()[0].startswith("kvshard demo: passed")


def test_one_request_of_160_answering_fails() -> None:
    """``ok`` is a count: 1 of 160 is not success."""
    outcome = decide(summary(ok=1, ramp=RAMP_OK))
    assert outcome.code == FAILED and outcome.reasons == ("159 of 160 replay requests failed",)


def test_a_single_failed_request_fails_and_so_does_no_request_at_all() -> None:
    assert decide(summary(ok=159, ramp=RAMP_OK)).reasons == ("1 of 160 replay requests failed",)
    nothing = decide(summary(requests=0, ok=0, agreement=None, pairs=0, ramp=RAMP_OK))
    assert nothing.code == FAILED and nothing.reasons == ("no request was sent",)


def test_failed_re_sent_pairs_and_ramp_requests_fail() -> None:
    outcome = decide(summary(pairs_failed=2, ramp={**RAMP_OK, "failed": 3}))
    assert outcome.code == FAILED
    assert outcome.reasons == ("2 of the requests re-sent for the comparison with full prefill failed",
                               "3 of 400 ramp requests failed")


@pytest.mark.parametrize(("agreement", "target", "code"), [
    (0.85, 90, FAILED), (0.9, 90, PASSED), (0.95, 90, PASSED), (0.35, 90, FAILED), (0.35, 0, PASSED),
    (0.999, 100, FAILED), (1.0, 100, PASSED)])
def test_agreement_below_the_fidelity_target_fails(agreement: float, target: int, code: int) -> None:
    outcome = decide(summary(agreement=agreement, ramp=RAMP_OK), target=target)
    assert outcome.code == code, outcome
    if code == FAILED:
        assert outcome.reasons == (f"agreement with full prefill {agreement:.1%} on 20 re-sent requests is below "
                                   f"the fidelity target {target} %",)


def test_agreement_never_measured_fails_only_when_pairs_were_asked_for() -> None:
    unmeasured = summary(agreement=None, pairs=0, ramp=RAMP_OK)
    assert decide(unmeasured).code == FAILED and "not measured" in decide(unmeasured).reasons[0]
    assert decide(unmeasured, pairs=0).code == PASSED  # --pairs 0: no comparison asked for
    assert decide(unmeasured, target=0).code == PASSED  # --fidelity-target 0: no target


@pytest.mark.parametrize("ramp", [
    {"outcome": "the ramp failed: RuntimeError: boom"},  # raised: a note in the summary
    {"outcome": "no ramp: the cluster did not settle on 2 pods: timed out"},
    {**RAMP_OK, "outcome": "timed out rising at 4 requests in flight", "completed": False},
    None])  # no section at all
def test_a_ramp_that_did_not_complete_fails_when_the_ramp_was_asked_for(ramp: Any) -> None:
    outcome = decide(summary(ramp=ramp))
    assert outcome.code == FAILED
    assert outcome.reasons[0].startswith("the autoscaling ramp did not")
    assert decide(summary(ramp=ramp), ramp=False).code == PASSED  # --no-ramp


def test_every_reason_is_printed_and_kept_in_the_summary() -> None:
    outcome = decide(summary(ok=150, agreement=0.5, ramp={"outcome": "no ramp: x"}))
    assert outcome.code == FAILED and len(outcome.reasons) == 3
    lines = outcome.lines()
    assert lines[0] == "kvshard demo: FAILED (3 reasons):" and all(line.startswith("  - ") for line in lines[1:])
    assert outcome.as_json() == {"exit_code": 1, "reasons": list(outcome.reasons)}


def test_the_verdict_reads_the_summary_summarize_writes_and_render_prints_it() -> None:
    record = rep.Record(0, "steady", 0.0, 0.1, 200, "a", 1, "t", False, label="A")
    failed = rep.Record(1, "steady", 0.0, 0.1, 503, None, 1, "t", False)
    pairs = [rep.PrefillPair(0, "a", 10.0, 20.0, "A", "B")]
    doc = rep.summarize([record, failed], pairs, [], {}, ["a"], 1.0, ramp=RAMP_OK, pairs_failed=1)
    outcome = decide(doc)
    assert outcome.reasons == ("1 of 2 replay requests failed",
                               "1 of the requests re-sent for the comparison with full prefill failed",
                               "agreement with full prefill 0.0% on 1 re-sent requests is below the fidelity "
                               "target 90 %")
    doc["verdict"] = outcome.as_json()
    text = rep.render(doc)
    assert "Verdict: FAILED (exit code 1)" in text and "  - 1 of 2 replay requests failed" in text
    assert "(1 more re-sent got no answer)" in text
