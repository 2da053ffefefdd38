"""Isolating experiment for issue 20: is the *pointer* (answer with the right candidate's letter) or the
*content* signal (which unseen movie this user picks) what a short CPU fine-tune fails to learn?

Same trainer, same prompt, same settings as ``kvshard model finetune``, but every training and validation
request is made trivially answerable from content: the target is also one of the history items (it
replaces the history's last item). A model that can learn to point at a candidate should quickly
reach HR@1 near 1 here; if it stays at chance, the pointer itself is the bottleneck.

    .venv/bin/python bench/experiments/finetune_copy_probe.py --out /tmp/ft/copy --history 5 \\
        --candidates 4 --steps 30 --accumulation 16 --lr 1e-3 --warmup 3 --val-every 10 --val-users 64
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from kvshard.cli import build_parser
from kvshard_training import examples, finetune
from kvshard_training import settings as finetune_settings

_real_training = examples.training_requests  # where finetune's training_data looks them up
_real_validation = examples.validation_requests


def with_target_in_history(requests: list[Any]) -> list[Any]:
    return [dataclasses.replace(r, history=(*r.history[:-1], r.target)) for r in requests]


def main(argv: list[str]) -> int:
    examples.training_requests = lambda *a, **k: with_target_in_history(_real_training(*a, **k))  # type: ignore[assignment]
    examples.validation_requests = lambda *a, **k: with_target_in_history(_real_validation(*a, **k))  # type: ignore[assignment]
    words = ["model", "finetune", "--teacher", "none", *argv]
    result = finetune.train(finetune_settings.from_args(build_parser(words).parse_args(words)))
    print(f"copy task: validation HR@1 {result.validation['hr1']:.3f}, "
          f"max label share {result.validation['max_label_share']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
