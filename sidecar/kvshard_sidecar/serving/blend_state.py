"""The blend in force: the flags' until the followed CacheShard publishes its own, then the CacheShard's.

Why a module of its own: the blend settings a request is parsed with, the shadow checks' sample rate and
whether ``/readyz`` still waits for etcd all change together, from the event loop, between requests —
and this one object is where they do. A request parsed before a change keeps the settings it was parsed
with; settings this model cannot run are refused with a log line and the previous ones stay.
"""

from __future__ import annotations

import logging

from kvshard.blend_policy import BlendPolicy
from kvshard_sidecar.engine.isolated_scorer import prefill_context_for
from kvshard_sidecar.engine.methods import method_settings
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.serving.shadow import ShadowChecker
from kvshard_sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)


class BlendInForce:
    """The blend policy in force, its engine settings on this sidecar, and whether it is known yet."""

    def __init__(self, settings: SidecarSettings, scorer: str, shadow: ShadowChecker) -> None:
        self.settings = settings
        self.scorer = scorer
        self.shadow = shadow
        self.policy = BlendPolicy(settings.method, settings.ratio, settings.shadow_sample_rate, "Flags")
        """The blend settings in force: the flags', until the followed CacheShard publishes its own."""
        self.defaults = self.settings_of(self.policy)
        """What a request without its own ``blend`` is blended with."""
        self.known = not settings.etcd_endpoints
        """Whether the blend in force is known: at once without a CacheShard; following one, once its
        published blend (or that there is none) was read from etcd (:meth:`read`)."""
        self.gave_up = False
        """Whether readiness stopped waiting for the CacheShard's blend (logged once, by :meth:`awaited`)."""
        shadow.sample_rate = self.policy.sample_rate
        shadow.announce(self.policy.method, self.policy.ratio)

    def settings_of(self, policy: BlendPolicy) -> BlendSettings:
        """The engine settings of a blend policy on this sidecar's device (``--selector``, when given,
        replaces the method's selector: the flag of sidecars older than named methods)."""
        base = BlendSettings(device=self.settings.device, dtype=self.settings.dtype,
                             prefill_context=prefill_context_for(self.scorer))
        if self.settings.selector and policy.reason == "Flags":
            return base.with_(selector=self.settings.selector, ratio=policy.ratio)
        return method_settings(policy.method, policy.ratio, base)

    def use(self, policy: BlendPolicy, num_layers: int | None) -> None:
        """Make ``policy`` the blend in force, unless its settings are invalid for a model of ``num_layers``
        layers (None: not checked against a model)."""
        try:
            settings = self.settings_of(policy)
            settings.validate(num_layers)
        except ValueError as error:
            log.error("blend %s r=%g not applied: %s", policy.method, policy.ratio, error)
            return
        if not policy.same_settings(self.policy):
            log.info("blend in force: %s r=%g, shadow sample rate %g (%s)", policy.method, policy.ratio,
                     policy.sample_rate, policy.reason)
        self.policy, self.defaults = policy, settings
        self.shadow.sample_rate = policy.sample_rate
        self.shadow.announce(policy.method, policy.ratio)

    def read(self) -> None:
        """The followed CacheShard's blend was read (what it publishes is in force, or the flags' if it
        publishes none)."""
        if not self.known:
            log.info("blend in force known: %s r=%g (%s)", self.policy.method, self.policy.ratio, self.policy.reason)
        self.known = True

    def awaited(self, now: float, loaded_at: float | None) -> bool:
        """Whether readiness still waits for the followed CacheShard's blend (at most ``blend_wait_seconds``
        after the model loaded at ``loaded_at``). The first call that finds the wait over logs it, so the
        log says so no later than ``/readyz`` turns ready without the CacheShard's blend."""
        if self.known:
            return False
        if loaded_at is None or now - loaded_at < self.settings.blend_wait_seconds:
            return True
        if not self.gave_up:
            self.gave_up = True
            log.warning("no blend settings read from etcd within %g s; ready with the flags' (%s r=%g) until the "
                        "CacheShard's arrive", self.settings.blend_wait_seconds, self.policy.method, self.policy.ratio)
        return False
