"""bench/gpu/finetune_gpu.py trains the shipped late scorer's recipe per device — only device, batch,
accumulation, examples and output changed — and prints examples/s and validation HR@1 side by side; its CPU
half runs here on a tiny size."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from kvshard_bench.synthetic_catalog import CatalogShape, generate, write

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "finetune_gpu.py"


def _script() -> ModuleType:
    """bench/gpu is not a package: the script is loaded by path, as it is run on the GPU machine."""
    spec = importlib.util.spec_from_file_location("finetune_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_device_trains_the_shipped_recipe_with_only_its_own_settings_changed(tmp_path: Path) -> None:
    script = _script()
    shipped = json.loads(script.RECIPE.read_text())["settings"]
    recipe = script.recipe_settings()
    cuda = script.device_settings(recipe, "cuda", examples=100, batch=16, accumulation=16, val_users=96, out=tmp_path)
    cpu = script.device_settings(recipe, "cpu", examples=100, batch=1, accumulation=16, val_users=96, out=tmp_path)
    for name, value in shipped.items():
        if name not in script.RUN_FIELDS and hasattr(recipe, name):
            assert getattr(cuda, name) == (tuple(value) if isinstance(value, list) else value), name
    assert (cuda.scorer, cuda.interaction, cuda.precision) == ("late", 4, "bfloat16")
    assert (cuda.device, cuda.batch, cpu.device, cpu.batch) == ("cuda", 16, "cpu", 1)
    assert cuda.steps == cpu.steps == 7  # 100 examples in whole steps of 16
    assert cuda.out == tmp_path / "cuda" and cpu.out == tmp_path / "cpu"


def test_the_table_puts_examples_per_second_and_hr1_beside_the_cpus() -> None:
    rows = [{"device": "cuda", "name": "NVIDIA H200", "batch": 16, "examples": 4096, "seconds": 40.0,
             "examples_per_second": 102.4, "hr1": 0.41, "val_prompts": 96},
            {"device": "cpu", "name": "x86_64", "batch": 1, "examples": 128, "seconds": 128.0,
             "examples_per_second": 1.0, "hr1": 0.2, "val_prompts": 96}]
    lines = _script().format_table(rows).splitlines()
    assert lines[0].split() == ["device", "name", "batch", "examples", "seconds", "examples_per_second", "hr1",
                                "val_prompts", "speed-up"]
    assert lines[1].split()[-4:] == ["102.40", "0.410", "96", "102.4x"] and lines[2].split()[-1] == "1.0x"


@pytest.mark.model
def test_its_cpu_half_runs_here_and_reports_what_it_trained(tmp_path: Path) -> None:
    shape = CatalogShape(items=120, users=60, groups=6, min_history=12, max_history=16)
    catalog = write(generate(shape), shape, tmp_path / "catalog")
    rows = _script().main(["--devices", "cuda", "cpu", "--cpu-examples", "2", "--accumulation", "2",
                           "--val-users", "2", "--dataset", str(catalog), "--out", str(tmp_path / "runs"),
                           "--json", str(tmp_path / "rows.json")])
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    cpu = rows[-1]
    assert cpu["device"] == "cpu" and cpu["examples"] == 2 and cpu["val_prompts"] == 2 and cpu["batch"] == 1
    assert cpu["examples_per_second"] > 0 and 0.0 <= cpu["hr1"] <= 1.0
    provenance = json.loads((tmp_path / "runs" / "cpu" / "provenance.json").read_text())
    assert provenance["settings"]["scorer"] == "late" and provenance["device"]["kind"] == "cpu"
