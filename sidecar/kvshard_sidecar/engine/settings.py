"""One typed settings object for the blend engine, so a request, a benchmark row and a test all say
exactly which blend they ran.

Every knob of a blend (docs/blending-and-fidelity.md) lives here: the selector, its ratio, the check layers with their
gradual-filtering schedule, the boundary width, what deviation is measured on, how segment blocks
are prefilled, the training-free corrections (:mod:`.corrections`: tail weighting, structure-aware
and segment-granular picking, attention calibration) and where the engine runs. ``validate`` catches
contradictory settings early, with a message that names the field, instead of failing deep inside a
layer loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, cast

from kvshard.blend_policy import DEFAULT_METHOD, DEFAULT_RATIO

SelectorName = Literal["none", "boundary", "deviation", "hybrid", "tail", "cacheblend", "epic"]
DeviationOn = Literal["k", "v", "kv"]
DeviationWeight = Literal["none", "attention"]
PrefillContext = Literal["standalone", "system", "neutral", "averaged", "history"]
PREFILL_CONTEXTS: tuple[PrefillContext, ...] = ("standalone", "system", "neutral", "averaged", "history")
Granularity = Literal["token", "segment"]

SELECTORS: tuple[SelectorName, ...] = ("none", "boundary", "deviation", "hybrid", "tail", "cacheblend", "epic")
# Selectors that rank every candidate and keep the ratio's budget: the corrections reshape their picks.
BUDGETED: tuple[SelectorName, ...] = ("boundary", "deviation", "tail")
DEFAULT_SELECTOR = cast(SelectorName, DEFAULT_METHOD.split("+")[0])
"""The default method's selector (:data:`kvshard.blend_policy.DEFAULT_METHOD`, the one place defaults live)."""


class SettingsError(ValueError):
    """A :class:`BlendSettings` field is out of range or contradicts another field."""


@dataclass(frozen=True)
class BlendSettings:
    """How one request is blended.

    Attributes:
        selector: which tokens are recomputed after the check layers: ``none`` (only the suffix),
            ``boundary`` (first ``boundary_w`` tokens of every blended segment), ``deviation``
            (top tokens by KV deviation at the check layers), ``hybrid`` (boundary ∪ deviation),
            ``tail`` (the candidates closest to the question: the last ``ratio`` of them), and the two
            published baselines, reproduced as defined: ``cacheblend`` (LMCache's CacheBlend: K
            deviation at the check layers, top-r, no gradual narrowing, no attention weighting) and
            ``epic`` (EPIC's LegoLink: the first ``epic_k`` tokens of every blended block). Both are
            meant to run on ``standalone`` blocks (:mod:`.methods` presets them so).
        ratio: the final recompute ratio r: the share of *blendable* tokens (those whose cached KV
            is not already exact, i.e. not part of the exact prefix, and not forced) recomputed
            after the last check layer. ``1.0`` reproduces a full prefill.
        check_layers: layers at which deviation is scored (``deviation``/``hybrid``); every layer up
            to the last check layer runs for the whole candidate set.
        schedule: the ratio kept at each check layer (gradual filtering); must narrow and end at
            ``ratio``. Empty means "``ratio`` at every check layer".
        boundary_w: tokens at the start of each blended segment that ``boundary``/``hybrid`` recompute.
            ``None`` for ``boundary`` means "spend the ratio's budget on segment starts": the first
            token of every segment, then the second, ... until ``ratio`` is used up. ``hybrid`` pins
            the first ``boundary_w`` (default 1) tokens of each segment, within the ratio's budget,
            and fills the rest of the budget by deviation.
        deviation_on: score deviation on keys (``k``), values (``v``) or both, each normalised by its
            mean (``kv``).
        deviation_weight: ``attention`` multiplies each token's deviation by the attention the forced
            (suffix) queries pay it at the check layer — an estimate of how much its error reaches the
            answer; ``none`` ranks by deviation alone (CacheBlend).
        recompute_free: always recompute FREE segments (tiny labels and headers) like the suffix.
        epic_k: ``epic``'s k (tokens recomputed at the start of every blended block). ``None`` derives
            it from ``ratio``: the largest k whose recompute fits the ratio's budget (so r = 1 is
            full and r = 0 recomputes only the suffix).
        tail_weight: closeness-to-the-question weighting in ``[0, 1]`` for the budgeted selectors
            (``boundary``, ``deviation``, ``tail``): a token's priority is ``(1 − w)·rank(score) +
            w·closeness`` (both in [0, 1]); 0 is the plain selector, 1 is pure ``tail``.
        structure: structure-aware picking: the ``Candidates:`` header is recomputed first, and a
            label is recomputed exactly when some of its item is (never alone, never stale beside a
            fresh item), all inside the ratio's budget.
        labels_first: every candidate's label rows are recomputed before the selector's own picks
            (the ones closest to the question first when not all fit), the rest of the budget by
            priority. With the label after its item (``<item> [A]``) a fine-tuned recommender points
            at a candidate through its label tokens, which read the item: stale, they were computed
            without it, and no other row can stand in (``--attribution``: exact labels alone give full
            prefill's answer).
        granularity: ``token`` picks tokens; ``segment`` spends the budget on whole label+item units
            (and the header, the history) in order of their mean priority, so no block is left half
            fresh and half stale.
        attention_temperature: APE-style calibration: attention logits to blended rows that were not
            recomputed are divided by this (1 = off).
        attention_scale: APE-style calibration: the attention weight of those rows is multiplied by
            this before normalisation (1 = off). Both are calibrated per model
            (:mod:`kvshard_sidecar.engine.calibration`).
        prefill_context: how segment blocks are prefilled: ``standalone`` (each at position 0, as in
            CacheBlend), ``system`` (behind the prompt's system segment, which is then an exact
            prefix, and so is the first segment after it) or ``neutral`` (like ``system`` for the
            first segment after it; every later segment behind the system segment followed by the
            ``neutral_context`` tokens, a short fixed text shaped like what precedes it in prompts) or
            ``averaged`` (like ``neutral`` with ``averaged_contexts[0]`` as the text, but every item
            block is the mean of its position-free KV over one prefill behind each of
            ``averaged_contexts``; see :mod:`.contexts`) or ``history`` (the history behind the system
            segment, exact; every other block alone, as ``standalone``: what the late-interaction
            scorer's items read, so it is served exactly).
        neutral_context: token ids of that text (``neutral`` mode only).
        averaged_contexts: token ids of each appearance's context (``averaged`` mode only; one
            appearance is ``neutral`` with that text).
        device: torch device of the model.
        dtype: ``float32`` on CPU; ``bfloat16``/``float16`` on CUDA.
        threads: torch intra-op threads; ``None`` leaves torch's default.
    """

    selector: SelectorName = DEFAULT_SELECTOR  # the measured default: kvshard.blend_policy
    ratio: float = DEFAULT_RATIO
    check_layers: tuple[int, ...] = (1,)
    schedule: tuple[float, ...] = ()
    boundary_w: int | None = None
    deviation_on: DeviationOn = "kv"
    deviation_weight: DeviationWeight = "none"
    recompute_free: bool = False
    epic_k: int | None = None
    tail_weight: float = 0.0
    structure: bool = False
    labels_first: bool = False
    granularity: Granularity = "token"
    attention_temperature: float = 1.0
    attention_scale: float = 1.0
    prefill_context: PrefillContext = "system"
    neutral_context: tuple[int, ...] = ()
    averaged_contexts: tuple[tuple[int, ...], ...] = ()
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = field(default=None, compare=False)

    def with_(self, **changes: object) -> BlendSettings:
        """A copy with ``changes`` applied and validated."""
        updated = replace(self, **changes)  # type: ignore[arg-type]
        updated.validate()
        return updated

    @property
    def ratios(self) -> tuple[float, ...]:
        """The ratio kept at each check layer (the schedule, or ``ratio`` everywhere)."""
        return self.schedule or tuple(self.ratio for _ in self.check_layers)

    @property
    def uses_deviation(self) -> bool:
        return self.selector in ("deviation", "hybrid", "cacheblend")

    @property
    def corrects_picks(self) -> bool:
        """Whether a pick correction (tail weighting, structure, labels first, segment granularity) is on."""
        return self.tail_weight > 0 or self.structure or self.labels_first or self.granularity == "segment"

    @property
    def calibrates_attention(self) -> bool:
        return self.attention_temperature != 1.0 or self.attention_scale != 1.0

    def validate(self, num_layers: int | None = None) -> None:
        """Raise :class:`SettingsError` on settings that cannot run."""
        if self.selector not in SELECTORS:
            raise SettingsError(f"selector must be one of {SELECTORS}, got {self.selector!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise SettingsError(f"ratio must be in [0, 1], got {self.ratio}")
        if self.deviation_on not in ("k", "v", "kv"):
            raise SettingsError(f"deviation_on must be 'k', 'v' or 'kv', got {self.deviation_on!r}")
        if self.deviation_weight not in ("none", "attention"):
            raise SettingsError(f"deviation_weight must be 'none' or 'attention', got {self.deviation_weight!r}")
        if self.prefill_context not in PREFILL_CONTEXTS:
            raise SettingsError(f"prefill_context must be one of {PREFILL_CONTEXTS}, got {self.prefill_context!r}")
        if (self.prefill_context == "neutral") != bool(self.neutral_context):
            raise SettingsError("neutral_context (token ids) is required by, and only used in, 'neutral' mode")
        if (self.prefill_context == "averaged") != bool(self.averaged_contexts):
            raise SettingsError("averaged_contexts (token ids per appearance) is required by, and only used in, "
                                "'averaged' mode")
        if any(not context for context in self.averaged_contexts):
            raise SettingsError("every averaged_contexts entry needs at least one token")
        if self.epic_k is not None and self.epic_k < 0:
            raise SettingsError(f"epic_k must be >= 0, got {self.epic_k}")
        if not 0.0 <= self.tail_weight <= 1.0:
            raise SettingsError(f"tail_weight must be in [0, 1], got {self.tail_weight}")
        if self.granularity not in ("token", "segment"):
            raise SettingsError(f"granularity must be 'token' or 'segment', got {self.granularity!r}")
        if self.corrects_picks and self.selector not in BUDGETED:
            raise SettingsError(
                f"tail_weight, structure and segment granularity reshape the picks of {', '.join(BUDGETED)}; "
                f"selector {self.selector!r} has no budgeted ranking to reshape"
            )
        if self.corrects_picks and self.selector == "boundary" and self.boundary_w is not None:
            raise SettingsError("pick corrections need boundary's budget form (boundary_w unset)")
        if self.selector == "cacheblend" and self.schedule:
            raise SettingsError("cacheblend keeps one ratio at its check layers (no gradual filtering): "
                                "schedule must be empty")
        for name in ("attention_temperature", "attention_scale"):
            value = getattr(self, name)
            if not (0.05 <= value <= 20.0):
                raise SettingsError(f"{name} must be in [0.05, 20], got {value}")
        if self.boundary_w is not None and self.boundary_w < 0:
            raise SettingsError(f"boundary_w must be >= 0, got {self.boundary_w}")
        layers = self.check_layers
        if self.uses_deviation and not layers:
            raise SettingsError(f"selector {self.selector!r} needs at least one check layer")
        if any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
            raise SettingsError(f"check_layers must be strictly increasing, got {layers}")
        if layers and layers[0] < 1:
            raise SettingsError(
                "check layers start at 1: layer 0's K/V depend only on the token and its position, "
                "so cached and fresh agree there and deviation says nothing"
            )
        if num_layers is not None and layers and layers[-1] >= num_layers:
            raise SettingsError(f"check layer {layers[-1]} is beyond the model's {num_layers} layers")
        if self.schedule:
            if len(self.schedule) != len(layers):
                raise SettingsError(
                    f"schedule has {len(self.schedule)} ratios for {len(layers)} check layers"
                )
            if any(b > a for a, b in zip(self.schedule, self.schedule[1:], strict=False)):
                raise SettingsError(f"schedule must narrow (non-increasing), got {self.schedule}")
            if abs(self.schedule[-1] - self.ratio) > 1e-9:
                raise SettingsError(
                    f"schedule must end at ratio {self.ratio}, got {self.schedule[-1]}"
                )
        if self.threads is not None and self.threads < 1:
            raise SettingsError(f"threads must be >= 1, got {self.threads}")
