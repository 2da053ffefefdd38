"""Issue 20 follow-up: ``kvshard bench recommender`` for an adapter trained with the label after its
item (``finetune_label_position_probe.py --label-position after``), base and fine-tuned side by side.

The adapter is merged into a model folder as ``kvshard model prepare`` merges the shipped one
(:func:`kvshard_training.merge.merge_adapter`), and *both* models are asked with the
``<item> [A]`` prompts the adapter was trained on (``labelPosition: after`` for every model; the bench
by itself asks each model as its merge record says it was trained, and the base in ``A. <item>``)::

    .venv/bin/python bench/experiments/label_after_recommender.py --adapter /tmp/ft/after-rec \\
        --merged /tmp/ft/after-rec-model -- --history 10 --users 100 --json /tmp/ft/after-rec-bench.json

Measured (2026-12-01, this 2-core machine). The adapter: ``finetune_label_position_probe.py
--label-position after --out /tmp/ft/after-rec --history 10 --candidates 20 --steps 400 --accumulation 4
--minutes 40 --lr 1e-3 --warmup 10 --val-every 75 --val-users 48`` (item-kNN teacher at weight .5, LoRA
rank 8 on the top 15 layers; the 40-minute budget stopped it after 301 steps, 1,204 examples).
Validation (48 training users' second-to-last items) HR@1 .104 / .250 / .250 / .292 at steps 75 /
150 / 225 / 301, most chosen letter 10–17 %; the teacher alone .521. The bench above, 100 held-out
users × 3 candidate orders:

| model | HR@1 (95 % CI) | HR@5 | NDCG@10 | position consistency | most chosen letter |
|---|---|---|---|---|---|
| SmolLM2-135M-Instruct | .053 (.03–.08) | .227 | .224 | .01 | 49 % (M) |
| + this adapter | .233 (.17–.30) | .593 | .489 | .41 | 11 % (G) |
| random | .050 | .250 | .227 | .0025 | ~5 % |

Every run with the label before its item (up to 35 minutes, about 850 examples) had stayed at chance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvshard import models
from kvshard.cli import main as kvshard_main
from kvshard_sidecar.engine.model import default_model_path
from kvshard_training import merge as adapter_merge


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", type=Path, required=True, help="the probe's output folder")
    parser.add_argument("--merged", type=Path, required=True, help="where the merged model folder goes")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="flags of `kvshard bench recommender` after --")
    args = parser.parse_args(argv)
    merged = adapter_merge.merge_adapter(default_model_path(), args.adapter, args.merged)
    models.model_prompt = lambda model: {"labelPosition": "after"}  # type: ignore[assignment]
    rest = [word for word in args.bench if word != "--"]
    return kvshard_main(["bench", "recommender", "--models", "base", str(merged), *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
