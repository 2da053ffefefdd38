"""The standalone GPU timing script (bench/gpu/late_scorer_gpu.py) runs on a tiny model on the CPU and
serves the late scorer exactly: cached, rotated item bodies give the late model's scores, the prefix
cache gives the causal model's, and each mode computes fewer tokens than the one it replaces."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "late_scorer_gpu.py"
TINY = ["--tiny", "--device", "cpu", "--dtype", "float32", "--check", "--repeats", "1", "--warmup", "1",
        "--candidates", "4", "--item-tokens", "6", "--history", "3"]
KEYS = {"mode", "candidates", "item_tokens", "history", "ttft_ms", "tokens_computed", "device", "dtype", "shape"}


def _script() -> ModuleType:
    """bench/gpu is not a package: the script is loaded by path, as it is run on the GPU machine."""
    spec = importlib.util.spec_from_file_location("late_scorer_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, dict[str, Any]]]:
    out = tmp_path_factory.mktemp("gpu") / "rows.json"
    code = _script().main([*TINY, "--json", str(out)])
    return code, {row["mode"]: row for row in json.loads(out.read_text())}


def test_the_check_passes_kvshard_matches_the_late_mask_and_apc_matches_full(
        tiny_run: tuple[int, dict[str, dict[str, Any]]]) -> None:
    code, rows = tiny_run
    assert code == 0
    assert rows["kvshard"]["check_against"] == "late-mask reference"
    assert rows["kvshard"]["check_passed"] and rows["kvshard"]["check_max_abs_diff"] <= 1e-4
    assert rows["apc"]["check_against"] == "full"
    assert rows["apc"]["check_passed"] and rows["apc"]["check_max_abs_diff"] <= 1e-4


def test_every_mode_writes_a_row_with_the_listed_keys(tiny_run: tuple[int, dict[str, dict[str, Any]]]) -> None:
    _, rows = tiny_run
    assert set(rows) == {"full", "apc", "kvshard"}
    for row in rows.values():
        assert KEYS <= set(row)
        assert (row["candidates"], row["item_tokens"], row["history"]) == (4, 6, 3)
        assert (row["device"], row["dtype"], row["shape"]) == ("cpu", "float32", "tiny-llama")
        assert row["ttft_ms"] > 0


def test_kvshard_computes_fewer_tokens_than_apc_which_computes_fewer_than_full(
        tiny_run: tuple[int, dict[str, dict[str, Any]]]) -> None:
    _, rows = tiny_run
    p, k, n = 40 + 3 * 6, 4, 6
    assert rows["full"]["tokens_computed"] == k * (p + n + 1)
    assert rows["apc"]["tokens_computed"] == p + k * (n + 1)
    assert rows["kvshard"]["tokens_computed"] == p + k * (4 + 1)
    assert rows["kvshard"]["tokens_computed"] < rows["apc"]["tokens_computed"] < rows["full"]["tokens_computed"]


def test_the_check_fails_when_cached_keys_are_not_rotated(tmp_path: Path) -> None:
    """The tiny model is position-sensitive enough that a cache left at positions 0..n-1 is caught."""
    script = _script()
    script.rotate_keys = lambda keys, shift, inv_freq: keys  # type: ignore[attr-defined]
    out = tmp_path / "rows.json"
    assert script.main([*TINY, "--json", str(out)]) == 1
    kvshard = next(row for row in json.loads(out.read_text()) if row["mode"] == "kvshard")
    assert not kvshard["check_passed"] and kvshard["check_max_abs_diff"] > 1e-4


def test_rotating_cached_keys_by_p_equals_the_models_rope_at_the_shifted_positions() -> None:
    """R(p + j) = R(p) R(j) with the model's own llama3-scaled inv_freq, up to float32 rounding."""
    script = _script()
    config = script.llama_config(tiny=True)
    model = script.build_model(config, torch.device("cpu"), torch.float32)
    rotary = model.model.rotary_emb
    raw = torch.randn(1, 2, 5, config.hidden_size // config.num_attention_heads,
                      generator=torch.Generator().manual_seed(0))

    def rope_at(positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(raw, positions[None])
        half = raw.shape[-1] // 2
        swapped = torch.cat([-raw[..., half:], raw[..., :half]], dim=-1)
        rotated: torch.Tensor = raw * cos[:, None] + swapped * sin[:, None]
        return rotated

    for p in (1, 58, 4000):
        moved = script.rotate_keys(rope_at(torch.arange(5)), p, rotary.inv_freq)
        torch.testing.assert_close(moved, rope_at(torch.arange(p, p + 5)), atol=2e-4, rtol=1e-4)
