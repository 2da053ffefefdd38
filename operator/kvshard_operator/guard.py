"""The fidelity guard's I/O for one CacheShard: spec → blend in force in etcd; Prometheus → decision.

The decision is :func:`kvshard_operator.fidelity_policy.decide` (pure, replayed on recorded series in
tests); this module is the thin adapter around it, free of kopf so tests drive it with a real etcd and
a real Prometheus. Every tick of the handlers' guard timer:

1. publish the blend the spec asks for (``spec.blend`` over kvshard's defaults, the sample rate of
   ``spec.fidelity``) when etcd holds none or holds one for another method, sample rate or starting
   ratio (the spec changed) — compare-and-swap on the ``blend`` key's version, like placements;
2. with ``spec.fidelity``, once per ``intervalSeconds``: count the shadow checks at the method and
   ratio in force over ``windowSeconds`` (``kvshard_sidecar_fidelity_checks_total``, this shard's
   series only), decide, and publish a changed ratio with compare-and-swap (a conflict skips the
   interval: someone else wrote; the next one re-reads);
3. return ``status.blend``, ``status.fidelity`` and the ``FidelityMet`` condition.

After an operator restart, a published ratio for the same method and sample rate inside
``[minRatio, maxRatio]`` is kept (the controller resumes) rather than reset to the spec's start.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Mapping
from typing import Any

from kvshard import blend_policy as bp
from kvshard import etcd_store
from kvshard_operator import conditions as cond
from kvshard_operator import etcd_clients, metrics, validation
from kvshard_operator.fidelity_policy import Counts, Decision, Memory, Target, decide
from kvshard_operator.prometheus import PrometheusClient, PrometheusError, promql_string, shard_selector, window
from kvshard_operator.reconcile import SecretReader, etcd_access
from kvshard_operator.settings import Settings

FIDELITY_MET = "FidelityMet"
CHECKS = ("sum by (result) (increase(kvshard_sidecar_fidelity_checks_total{{{shard},method={method},"
          "ratio={ratio}}}[{window}]))")
"""Shadow checks by result at one method and ratio over the window."""


@dataclasses.dataclass
class GuardState:
    """Per-CacheShard memory between ticks (kopf's memo)."""

    spec_key: tuple[Any, ...] | None = None
    """The spec's blend and fidelity fields the published policy was derived from."""
    decided_at: float | None = None
    memory: Memory = dataclasses.field(default_factory=Memory)
    last: Decision | None = None


@dataclasses.dataclass(frozen=True)
class GuardOutcome:
    """What one tick did: the status fields to patch and, with spec.fidelity, the decision."""

    status: dict[str, Any]
    published: bp.BlendPolicy | None = None
    decision: Decision | None = None


def target(fidelity: Mapping[str, Any]) -> Target:
    low, high = bp.ratio_bounds(fidelity)
    return Target(agreement=int(fidelity["targetAgreementPercent"]) / 100, min_ratio=low, max_ratio=high,
                  min_samples=int(fidelity.get("minSamples", 20)))


def checks_query(namespace: str, name: str, method: str, ratio: float, window_seconds: float) -> str:
    return CHECKS.format(shard=shard_selector(namespace, name), method=promql_string(method),
                         ratio=promql_string(bp.ratio_label(ratio)), window=window(window_seconds))


async def read_counts(url: str, namespace: str, name: str, policy: bp.BlendPolicy, window_seconds: float,
                      timeout: float) -> Counts:
    """Agree / disagree / skipped checks at ``policy``'s method and ratio (``increase()`` extrapolates:
    rounded to whole checks). :class:`PrometheusError` when Prometheus cannot answer."""
    async with PrometheusClient(url, timeout=timeout) as prom:
        found = await prom.by_label(checks_query(namespace, name, policy.method, policy.ratio, window_seconds),
                                    "result")
    return Counts(agree=round(found.get("agree", 0.0)), disagree=round(found.get("disagree", 0.0)),
                  skipped=round(found.get("skipped", 0.0)))


def _spec_key(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    blend, fidelity = spec.get("blend") or {}, spec.get("fidelity") or {}
    return (blend.get("method"), blend.get("ratioPercent"), fidelity.get("sampleRatePercent"),
            fidelity.get("minRatioPercent"), fidelity.get("maxRatioPercent"))


def _resumable(published: bp.BlendPolicy | None, wanted: bp.BlendPolicy, fidelity: Mapping[str, Any] | None) -> bool:
    """Whether a policy found in etcd after a restart continues the controller's work for this spec."""
    if published is None or not fidelity:
        return False
    low, high = bp.ratio_bounds(fidelity)
    return (published.method, published.sample_rate) == (wanted.method, wanted.sample_rate) and \
        low - 1e-9 <= published.ratio <= high + 1e-9


def _timestamp(at: float) -> str:
    return datetime.datetime.fromtimestamp(int(at), datetime.UTC).isoformat().replace("+00:00", "Z")


def _status(status: Mapping[str, Any], generation: int | None, policy: bp.BlendPolicy,
            fidelity: Mapping[str, Any] | None, decision: Decision | None, at: float) -> dict[str, Any]:
    out: dict[str, Any] = {"blend": {"method": policy.method, "ratioPercent": round(policy.ratio * 100),
                                     "reason": policy.reason}}
    if fidelity and decision is None:
        # a spec change restarts the controller: drop the previous spec's measurement (the local-cluster
        # run showed the new starting ratio beside the old ratio's agreement until the first interval ended)
        out["fidelity"] = {"samples": 0, "windowSeconds": int(fidelity["windowSeconds"])}
        out["conditions"] = cond.set_condition(status.get("conditions"), FIDELITY_MET, cond.UNKNOWN,
                                               "InsufficientSamples", "no fidelity interval has ended yet",
                                               observed_generation=generation)
    elif fidelity and decision is not None:
        fields: dict[str, Any] = {"samples": decision.samples, "windowSeconds": int(fidelity["windowSeconds"]),
                                  "lastDecisionTime": _timestamp(at)}
        if decision.agreement is not None:
            fields["agreementPercent"] = int(decision.agreement * 100)
        if decision.lower is not None:
            fields["lowerBoundPercent"] = int(decision.lower * 100)
        out["fidelity"] = fields
        out["conditions"] = cond.set_condition(status.get("conditions"), FIDELITY_MET, decision.status,
                                               decision.reason, decision.message, observed_generation=generation)
    return out


async def guard_shard(
    *, namespace: str, name: str, spec: Mapping[str, Any], status: Mapping[str, Any], generation: int | None,
    settings: Settings, state: GuardState, logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
    now: float, read_secret: SecretReader | None = None, etcd: etcd_clients.EtcdClients | None = None,
) -> GuardOutcome | None:
    """One tick (see the module docstring); None when there is nothing to do or etcd is away (logged)."""
    try:
        spec = validation.validate_spec(spec)
    except validation.InvalidCacheShardError:
        return None  # the change handlers report the spec
    fidelity = spec.get("fidelity")
    wanted = bp.from_spec(spec)
    key = _spec_key(spec)
    published: bp.BlendPolicy | None = None
    decision: Decision | None = None
    try:
        access = await etcd_access(spec, namespace, read_secret)
        async with etcd_clients.session(access, timeout=settings.etcd_timeout_seconds, clients=etcd) as store:
            current, version = await store.read_blend(namespace, name)
            if state.spec_key is None and (_resumable(current, wanted, fidelity) or wanted.same_settings(current)):
                state.spec_key = key  # an operator restart: resume from the published ratio
            if current is None or state.spec_key != key or not (
                    (current.method, current.sample_rate) == (wanted.method, wanted.sample_rate)
                    and (fidelity or current.ratio == wanted.ratio)):
                await store.publish_blend(namespace, name, wanted, expected=version)
                published, current = wanted, wanted
                state.spec_key, state.decided_at, state.memory, state.last = key, now, Memory(), None
                logger.info("blend in force: %s r=%g, shadow sample rate %g (from the spec)", wanted.method,
                            wanted.ratio, wanted.sample_rate)
            elif fidelity and (state.decided_at is None or now - state.decided_at >= float(fidelity["intervalSeconds"])
                               - settings.fidelity_check_seconds / 2):
                state.decided_at = now
                try:
                    counts: Counts | None = await read_counts(
                        spec["prometheus"]["url"], namespace, name, current, float(fidelity["windowSeconds"]),
                        settings.prometheus_timeout_seconds)
                    problem = ""
                except PrometheusError as exc:
                    counts, problem = None, str(exc)
                decision = decide(current.ratio, counts, target(fidelity), state.memory, problem)
                state.memory, state.last = decision.memory, decision
                metrics.FIDELITY_DECISIONS.labels(decision.reason).inc()
                logger.info("fidelity: %s", decision.message)
                if decision.step:
                    new = dataclasses.replace(current, ratio=decision.ratio, reason=decision.reason)
                    await store.publish_blend(namespace, name, new, expected=version)
                    published, current = new, new
    except etcd_store.GenerationConflictError as exc:
        logger.warning("fidelity guard skipped this tick: %s", exc)
        return None
    except (etcd_store.EtcdStoreError, bp.BlendPolicyError, ValueError) as exc:
        logger.warning("fidelity guard cannot reach the blend in etcd: %s", exc)
        return None
    shard = metrics.shard_label(namespace, name)
    metrics.BLEND_RATIO.labels(shard).set(current.ratio)
    if fidelity:
        metrics.FIDELITY_TARGET.labels(shard).set(int(fidelity["targetAgreementPercent"]) / 100)
        metrics.FIDELITY_MAX_RATIO.labels(shard).set(bp.ratio_bounds(fidelity)[1])
    return GuardOutcome(_status(status, generation, current, fidelity, decision or state.last, state.decided_at or now),
                        published, decision)
