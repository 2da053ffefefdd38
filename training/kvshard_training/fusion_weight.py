"""``kvshard model fusion-weight``: choose the retrieval stage's weight in a trained model's served ranking,
and record it in the adapter's provenance.

Why it exists. Behind a retrieval stage the sidecar ranks by ``z(model) + W · z(stage score)``
(:func:`kvshard.ranking.fuse_scores`). One fixed ``W`` serves some models badly: at 1 : 1 the shipped late
scorer ranked held-out users' next items *below* the stage's score alone (HR@1 −.035, paired 95 % CI −.060
… −.006 on 955 requests), while the weight chosen on training users' validation prompts (2) carried over to
held-out users (``bench/experiments/fusion_weight.py``). How much the stage should weigh depends on how
much the model adds to it, so it is chosen per model: ``kvshard model finetune`` does it at its final
validation; this command does it for an adapter trained before that, or on more prompts than training
validated on. It scores the adapter's own validation prompts (training users' second-to-last items, as
its provenance's settings draw them), fits the weight (:func:`kvshard.ranking.choose_fusion_weight`), prints
it beside every weight of :data:`kvshard.ranking.FUSION_WEIGHTS`, and writes the choice as
``served_fusion`` into ``provenance.json``; ``kvshard model prepare`` (or ``merge``)
then carries it into the merged model, where the sidecar takes it as the default ``retrieval_weight``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.prompts import PromptBuilder, PromptTemplate
from kvshard.ranking import FusionChoice, choose_fusion_weight
from kvshard.splits import validation_requests
from kvshard_sidecar.engine.isolated_scorer import readout_id
from kvshard_sidecar.engine.model import default_model_path, load_model
from kvshard_training.examples import split_users, validation_set
from kvshard_training.lora import lora_model, warm_start
from kvshard_training.losses import order_scores
from kvshard_training.merge import Adapter
from kvshard_training.report import PROVENANCE_FILE, write_json_atomic
from kvshard_training.settings import FinetuneSettings, cpu_has_bfloat16
from kvshard_training.teacher import ItemKnnTeacher

log = logging.getLogger(__name__)

def trained_settings(provenance: dict[str, Any], prompts: int) -> FinetuneSettings:
    """The settings an adapter was trained with (its provenance's ``settings``; not its folders: the base is
    ``--base``), asking ``prompts`` validation prompts."""
    recorded = FinetuneSettings.from_record(provenance.get("settings") or {},
                                            exclude=("out", "model", "init_adapter", "teacher_model"))
    return dataclasses.replace(recorded, val_users=prompts)


@torch.inference_mode()
def choose(adapter_folder: Path, base_folder: Path, prompts: int = 300,
           progress: bool = True) -> FusionChoice:
    """Score ``prompts`` of the adapter's validation prompts with base + adapter (as fine-tuning validates,
    one candidate order: the stage's weight is chosen for the ranking, not for an order) and choose."""
    adapter = Adapter.read(adapter_folder)
    settings = trained_settings(adapter.provenance, prompts)
    torch.set_num_threads(settings.threads)
    # The trained precision where this CPU computes it; emulated bfloat16 is ~20x slower and moves a score by
    # rounding only (the weight is fitted over z-scores).
    loaded = load_model(base_folder, dtype=settings.precision if cpu_has_bfloat16() else "float32")
    peft_model = lora_model(loaded.model, settings)
    warm_start(peft_model, adapter_folder, base_folder)
    peft_model.eval()
    causal_lm = peft_model.get_base_model()
    dataset = load_dataset(settings.dataset)
    _, training_users, users = split_users(settings, dataset)
    builder = PromptBuilder(loaded.tokenizer, dataset, template=PromptTemplate(label_position=settings.label_position))
    teacher = ItemKnnTeacher(dataset.histories, training_users)
    requests = validation_requests(dataset, users, settings.history, settings.candidates, prompts, settings.seed + 1)
    examples, stage = validation_set(settings, requests, builder, teacher, random.Random(f"{settings.seed}-fusion"),
                                     orders=1)
    readout = readout_id(loaded.tokenizer) if settings.scorer != "answer" else 0
    model = [order_scores(causal_lm, example, readout)[0].float().tolist()
             for example in tqdm(examples, desc="fusion-weight", unit="prompt", disable=not progress)]
    return choose_fusion_weight(model, stage, [int(example.targets[0]) for example in examples])


def record(adapter_folder: Path, choice: FusionChoice) -> None:
    """Write ``choice`` into the adapter's ``provenance.json`` as ``served_fusion`` (atomically)."""
    provenance = Adapter.read(adapter_folder).provenance
    provenance["served_fusion"] = {**choice.as_json(), "set": "validation prompts drawn as the adapter's settings "
                                   "draw them, one candidate order; the stage's score leaves each prompt's own "
                                   "user out", "chosen_by_command": "kvshard model fusion-weight"}
    write_json_atomic(adapter_folder / PROVENANCE_FILE, provenance)


def table(choice: FusionChoice) -> str:
    """Every weight's validation quality, the chosen one marked, and the stage's order beneath."""
    lines = [f"{'weight':>8}  {'HR@1':>6}  {'HR@5':>6}  {'NDCG@10':>7}"]
    for weight, metrics in choice.by_weight.items():
        mark = "  <- chosen" if weight == choice.weight else "  (the model alone)" if weight == 0 else ""
        lines.append(f"{weight:>8g}  {metrics['hr1']:>6.3f}  {metrics['hr5']:>6.3f}  {metrics['ndcg10']:>7.3f}{mark}")
    stage = choice.stage_alone
    lines.append(f"{'stage':>8}  {stage['hr1']:>6.3f}  {stage['hr5']:>6.3f}  {stage['ndcg10']:>7.3f}  (its own order)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``kvshard model fusion-weight``: choose, print the table, record (unless ``--dry-run``)."""
    if args.prompts < 1:
        raise SystemExit("--prompts must be at least 1")
    choice = choose(args.adapter, args.base or default_model_path(), args.prompts)
    print(table(choice))
    if args.dry_run:
        print(f"retrieval_weight {choice.weight:g} chosen on {choice.prompts} prompts (not recorded: --dry-run)")
        return 0
    record(args.adapter, choice)
    print(f"retrieval_weight {choice.weight:g} chosen on {choice.prompts} prompts, recorded in "
          f"{args.adapter / PROVENANCE_FILE}; `kvshard model prepare` (shipped adapters) or `kvshard model merge` "
          "carries it into the merged model")
    return 0
