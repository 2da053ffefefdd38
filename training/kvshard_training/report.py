"""What a fine-tuning run leaves behind besides the adapter: its loss curve and its provenance.

Shipped weights are only trustworthy with a record of how they were made (CONVENTIONS, "Measurements
and model work"): the exact command, the seed, the data split, how many steps and examples, the base
model's weights hash (which ``kvshard model prepare`` checks before merging), library versions, the
loss curve and the validation numbers. The curve is rewritten after every step, so a long run can be
watched (and a killed one still leaves its curve).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROVENANCE_FILE = "provenance.json"
CURVE_JSON = "loss_curve.json"
CURVE_PNG = "loss_curve.png"


@dataclass
class StepRecord:
    step: int
    examples: int
    loss: float
    loss_ema: float
    lr: float
    elapsed_s: float


@dataclass
class LossCurve:
    """Training loss per optimizer step and the validation points, written as JSON (and a PNG)."""

    steps: list[StepRecord] = field(default_factory=list)
    validation: list[dict[str, float]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"steps": [asdict(s) for s in self.steps], "validation": self.validation}

    def write(self, folder: Path, png: bool = False) -> None:
        write_json_atomic(folder / CURVE_JSON, self.as_json())
        if png:
            self.plot(folder / CURVE_PNG)

    def plot(self, path: Path) -> None:
        """Loss per step (raw and smoothed) and validation loss / HR@1; skipped without matplotlib."""
        try:
            import matplotlib
        except ImportError:
            log.info("matplotlib is not installed: no %s (the JSON curve has the same data)", path.name)
            return
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, loss_axes = plt.subplots(figsize=(7, 4.5))
        xs = [s.step for s in self.steps]
        loss_axes.plot(xs, [s.loss for s in self.steps], color="0.75", linewidth=0.8, label="train loss (step)")
        loss_axes.plot(xs, [s.loss_ema for s in self.steps], color="C0", label="train loss (EMA)")
        if self.validation:
            vx = [v["step"] for v in self.validation]
            loss_axes.plot(vx, [v["loss"] for v in self.validation], "o-", color="C1", label="validation loss")
            hr_axes = loss_axes.twinx()
            hr_axes.plot(vx, [v["hr1"] for v in self.validation], "s--", color="C2", label="validation HR@1")
            hr_axes.set_ylabel("HR@1")
            hr_axes.set_ylim(0, 1)
            hr_axes.legend(loc="upper right")
        loss_axes.set_xlabel("optimizer step")
        loss_axes.set_ylabel("cross-entropy over the candidate labels")
        loss_axes.legend(loc="upper left")
        loss_axes.set_title("kvshard model finetune")
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON beside ``path`` then rename, so a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temporary, path)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    import peft
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def device_record(device: str, batch: int) -> dict[str, object]:
    """Where the run trained: the device kind, its name (the GPU's, or the CPU's where the platform says), and
    the examples per forward pass — what an examples/s figure needs beside it to be read."""
    if device.startswith("cuda"):
        import torch  # only a CUDA run asks, and it has torch loaded already

        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = platform.processor() or platform.machine()
    return {"kind": device, "name": name, "batch": batch}
