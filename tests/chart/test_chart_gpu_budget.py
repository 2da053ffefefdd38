"""One card, two users: vLLM takes ``engine.vllm.gpuMemoryUtilization`` of it, and the sidecar's blend
engine (``engine.sidecar.device: cuda``) needs the rest for its own copy of the weights, its working
memory (the sidecar's own rule, :func:`kvshard_sidecar.engine.device_memory.need_for`), its memory tier
(``engine.sidecar.memoryBytes``: blocks it computes stay on the device) and a CUDA context.

These tests read every term from the rendered manifests (vLLM's flags, the sidecar's settings as it
would load them from its env) and check the budget on the cards the chart documents (values.yaml,
NOTES, docs/chart.md), with parameter counts computed from the models' shapes, not typed in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, REPO, Manifest, container, engine_pod, helm, render, resolved_env

from kvshard_sidecar.engine import device_memory

GIB = device_memory.GIB
CUDA_CONTEXT = GIB // 2
"""What a process's CUDA context (and the caching allocator's first pool) takes beyond its tensors."""

CARDS = {"24 GB (L4, A10G)": 22.0, "40 GB (A100)": 39.4, "80 GB (A100, H100)": 79.1}
"""The cards the chart documents, by the memory torch reports usable on each (GiB)."""

# Llama-shaped configs (config.json keys) of the chart's default model and an 8 B model.
SHAPES: dict[str, dict[str, Any]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True},
    "meta-llama/Llama-3.1-8B-Instruct": {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
}
EIGHT_B = "meta-llama/Llama-3.1-8B-Instruct"
AT_085 = {"engine": {"vllm": {"gpuMemoryUtilization": 0.85}}}
OVERRIDDEN = {"engine": {"vllm": {"gpuMemoryUtilization": 0.6}, "sidecar": {"memoryBytes": 8 << 30}}}
BYTES_PER_PARAMETER = {"float32": 4, "bfloat16": 2, "float16": 2}
ENGINE_POD = {"metadata.name": "kvs-kvshard-engine-0", "status.podIP": "10.244.1.7"}


def _values_file(tmp_path: Path, values: dict[str, Any], model: str | None = None) -> Path:
    """A values file (``--set`` would pass 0.85 as a string, which the schema refuses)."""
    values = {**values, "engine": {**values.get("engine", {}), **({"model": {"name": model}} if model else {})}}
    path = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def parameters(config: dict[str, Any]) -> int:
    """Parameters of a Llama-shaped decoder: embeddings (and an untied head), per layer attention
    (q, k, v, o), the gated MLP and two norms, and the final norm."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    embed = config["vocab_size"] * hidden * (1 if config["tie_word_embeddings"] else 2)
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config["intermediate_size"] + 2 * hidden
    return int(embed + layers * layer + hidden)


def test_parameter_counts_are_the_published_ones() -> None:
    assert parameters(SHAPES["HuggingFaceTB/SmolLM2-135M-Instruct"]) == 134_515_008
    assert parameters(SHAPES[EIGHT_B]) == 8_030_261_248


class Budget:
    """The GPU terms of one rendered engine pod on a card of ``card_gib``."""

    def __init__(self, objects: list[Manifest], card_gib: float) -> None:
        from kvshard import settings as settings_lib
        from kvshard_sidecar.settings import ENV_PREFIX, SidecarSettings

        pod = engine_pod(objects)
        flags = dict(a.split("=", 1) for a in container(pod, "vllm")["args"] if a.startswith("--") and "=" in a)
        sidecar = settings_lib.from_sources(SidecarSettings, None, ENV_PREFIX,
                                            resolved_env(container(pod, "sidecar"), field_refs=ENGINE_POD))
        assert sidecar.device.startswith("cuda"), "the budget is about a sidecar on the card"
        self.card = int(card_gib * GIB)
        self.vllm = int(float(flags["--gpu-memory-utilization"]) * self.card)
        weights = parameters(SHAPES[flags["--served-model-name"]]) * BYTES_PER_PARAMETER[sidecar.dtype]
        self.need = device_memory.need_for(weights)
        self.tier = sidecar.memory_bytes

    @property
    def left(self) -> int:
        return self.card - self.vllm

    @property
    def used(self) -> int:
        return self.vllm + self.need.total + self.tier + CUDA_CONTEXT

    def fits(self) -> bool:
        return self.used <= self.card

    def largest_weights(self) -> float:
        """The most weight bytes whose need fits in what the tier and the context leave."""
        room = self.left - self.tier - CUDA_CONTEXT
        return min(room - device_memory.MIN_MARGIN_BYTES, room / (1 + device_memory.ACTIVATION_MARGIN))


@pytest.mark.parametrize("card", CARDS)
def test_the_defaults_fit_every_documented_card(helm_bin: Path, card: str) -> None:
    budget = Budget(render(helm_bin), CARDS[card])
    assert budget.fits(), f"{card}: {budget.used / GIB:.2f} GiB used of {budget.card / GIB:.1f}"
    # what the sidecar checks at start, once vLLM holds its share: its weights and margin fit
    device_memory.check(budget.left - CUDA_CONTEXT, budget.card, budget.need, device=card)


def test_an_8b_models_second_copy_fits_an_80gb_card_at_the_defaults(helm_bin: Path) -> None:
    budget = Budget(render(helm_bin, sets=[f"engine.model.name={EIGHT_B}"]), CARDS["80 GB (A100, H100)"])
    assert budget.need.weights / GIB == pytest.approx(14.96, abs=0.01)
    assert budget.fits(), f"{budget.used / GIB:.2f} GiB used of {budget.card / GIB:.1f}"


def test_vllms_usual_085_share_fits_neither(helm_bin: Path, tmp_path: Path) -> None:
    """Why the default is 0.70: at 0.85 the default model's tier overflows a 24 GB card, and an 8 B
    model's copy does not fit an 80 GB one (the sidecar would refuse at start)."""
    small = Budget(render(helm_bin, _values_file(tmp_path, AT_085)), CARDS["24 GB (L4, A10G)"])
    assert not small.fits()
    big = Budget(render(helm_bin, _values_file(tmp_path, AT_085, EIGHT_B)), CARDS["80 GB (A100, H100)"])
    assert not big.fits()
    with pytest.raises(device_memory.DeviceMemoryError):
        device_memory.check(big.left - CUDA_CONTEXT, big.card, big.need)


_CARD_LINE = re.compile(r"^\s+(?P<name>.+?), (?P<gib>[\d.]+) GiB usable: vLLM (?P<vllm>[\d.]+) GiB, "
                        r"left (?P<left>[\d.]+) GiB,(?: weights up to (?P<weights>[\d.]+) GiB| (?P<none>no room))",
                        re.M)


@pytest.mark.parametrize("values", [{}, OVERRIDDEN], ids=["defaults", "overridden"])
def test_notes_print_the_same_arithmetic(helm_bin: Path, tmp_path: Path, values: dict[str, Any]) -> None:
    path = _values_file(tmp_path, values)
    out = helm(helm_bin, "install", "kvs", str(CHART), "--namespace", "recommend", "--dry-run=client", "-f", str(path))
    notes = out.split("NOTES:", 1)[1]
    objects = render(helm_bin, path)
    lines = {m["name"]: m for m in _CARD_LINE.finditer(notes)}
    assert list(lines) == list(CARDS), "NOTES name the documented cards"
    for name, gib in CARDS.items():
        budget, line = Budget(objects, gib), lines[name]
        assert float(line["gib"]) == gib
        assert float(line["vllm"]) == pytest.approx(budget.vllm / GIB, abs=0.051)
        assert float(line["left"]) == pytest.approx(budget.left / GIB, abs=0.051)
        weights = budget.largest_weights()
        if line["none"]:
            assert weights <= 0, f"{name}: NOTES say no room, but {weights / GIB:.2f} GiB of weights fit"
            continue
        assert float(line["weights"]) == pytest.approx(weights / GIB, abs=0.051)
        assert device_memory.need_for(int(weights)).total <= budget.left - budget.tier - CUDA_CONTEXT
        assert device_memory.need_for(int(weights) + GIB // 100).total > budget.left - budget.tier - CUDA_CONTEXT


def test_the_documented_cards_are_the_ones_values_and_readmes_name() -> None:
    values = (CHART / "values.yaml").read_text()
    docs = (REPO / "docs" / "chart.md").read_text()  # the GPU memory budget section moved here from README.md
    for name, gib in CARDS.items():
        size = name.split(" (")[0]
        assert f"{gib:.1f} GiB" in values and f"{gib:.1f} GiB" in docs, name
        assert size in values and size in docs, name
