"""``kvshard model finetune``: LoRA-tune SmolLM2 into a recommender for kvshard's own prompt.

Why it exists. SmolLM2-135M-Instruct answers "A" whatever the candidates are, so fidelity to it
measures agreement about a position bias, and HR@k measures nothing. This trains a small LoRA
adapter (``peft``) on exactly the prompt kvshard serves (:class:`kvshard.prompts.PromptBuilder`) so
the model's choice depends on the items. The data follow :mod:`kvshard.splits` (held-out users are
never seen; the examples, as tensors: :mod:`kvshard_training.examples`). What each step computes — the
scores, the loss and its options (the item-kNN teacher, ``--consistency``, ``--pointwise``,
``--retrieval-weight``, ``--scorer isolated|late``) — and how validation ranks is
:mod:`kvshard_training.losses`; this module is the loop: data, adapters, optimizer, time budget,
validation, provenance.

Throughput on a CPU decides what fits in an hour, so only the scored positions go through ``lm_head``,
LoRA can be limited to the upper layers (autograd then never records the lower ones), and the run
stops at a wall-clock budget. On a GPU (``--device auto|cuda``) the same loop runs there, the base in
bfloat16 under autocast as on a CPU that computes bfloat16 (``--precision auto``; float32 on one that would
only emulate it), and ``--batch N`` scores N isolated or late examples per forward pass
(:func:`~kvshard_sidecar.engine.isolated_scorer.batched_isolated_scores`: their block masks padded into
one, the same losses as one by one);
on the CPU one example at a time stays the default, and the forward skips the pairs the block mask hides
(:mod:`kvshard_training.block_attention`) and a late scorer's item bodies below the first adapted layer
(:mod:`kvshard_training.frozen_bodies`): the same losses, a step 1.21x as fast. The output folder
gets ``adapter_model.safetensors``, ``adapter_config.json``, ``provenance.json`` and the loss curve (JSON
after every step, PNG at each validation); :mod:`kvshard_training.merge` merges it into a prepared model
folder.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvshard.paths import cache_dir
from kvshard.ranking import choose_fusion_weight
from kvshard_sidecar.engine.isolated_scorer import readout_id
from kvshard_sidecar.engine.model import UnsupportedModelError, default_model_path, load_model
from kvshard_training.examples import Example, TrainingData, training_data
from kvshard_training.frozen_bodies import FrozenBodies
from kvshard_training.lora import lineage_seconds, lora_model, save_adapter, warm_start
from kvshard_training.losses import batch_losses, evaluate
from kvshard_training.merge import ADAPTER_WEIGHTS
from kvshard_training.model_teacher import ScorerTeacher, mixed_distribution
from kvshard_training.report import (
    PROVENANCE_FILE,
    LossCurve,
    StepRecord,
    device_record,
    library_versions,
    sha256_file,
    write_json_atomic,
)
from kvshard_training.settings import FinetuneSettings, from_args

log = logging.getLogger(__name__)

EMA = 0.9


def default_output() -> Path:
    return cache_dir() / "finetune" / "movielens-rec"


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1, time_used: float = 0.0) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to ``floor`` by ``total`` steps — or by
    the end of the time budget when that comes first (``time_used``: the budget's spent share, 0–1), so a
    run cut by its budget still ends annealed."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_used))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class FinetuneResult:
    out: Path
    steps: int
    examples: int
    elapsed_s: float
    validation: dict[str, float]


def check_tokenizer(tokenizer: Any, folder: Path, settings: FinetuneSettings) -> None:
    """Refuse, naming the folder, a base whose tokenizer cannot carry kvshard's prompt — before the data are
    built, rather than as a transformers error from inside the prompt builder.

    Any Llama-family folder loads (:func:`~kvshard_sidecar.engine.model.load_model`), but kvshard's prompt is
    a chat (a system turn, then the user's history and candidates), so the tokenizer needs a chat template:
    a base model's tokenizer often has none. The isolated and late scorers read one vocabulary row
    (:func:`~kvshard_sidecar.engine.isolated_scorer.readout_id`, ``" yes"``), which must be one token."""
    if not getattr(tokenizer, "chat_template", None):
        raise UnsupportedModelError(f"{folder}: its tokenizer has no chat template, and kvshard's prompt is a chat "
                                    "(system turn, user turn): use an instruct model's folder, or add its "
                                    "chat_template.jinja to the folder")
    if settings.scorer != "answer":
        try:
            readout_id(tokenizer)
        except ValueError as error:
            raise UnsupportedModelError(f"{folder}: {error} in this tokenizer; --scorer {settings.scorer} reads "
                                        "that one vocabulary row (use --scorer answer)") from None


def taught(example: Example, teacher: ScorerTeacher, settings: FinetuneSettings) -> Example:
    """``example`` with its soft target mixed from item-kNN's (if any) and ``teacher``'s scores
    (:func:`~kvshard_training.model_teacher.mixed_distribution`)."""
    scores = teacher.scores(example.isolated, example.alignment).to(example.targets.device)
    return replace(example, soft=mixed_distribution(example.soft, scores, settings.teacher_model_weight,
                                                    settings.teacher_temperature))


def optimizer_step(causal_lm: Any, optimizer: torch.optim.Optimizer, trainable: Sequence[torch.Tensor],
                   batch: Sequence[Example], settings: FinetuneSettings, readout: int,
                   log_scale: torch.Tensor | None = None, bodies: FrozenBodies | None = None) -> float:
    """One optimizer step on ``batch`` (``--accumulation`` examples, ``--batch`` per forward pass): the
    mean loss's gradient, clipped to ``--clip`` over ``trainable``, one update. Returns the mean loss."""
    step_loss = 0.0
    for start in range(0, len(batch), settings.batch):
        # the fusion's temperature enters each pass's graph anew: a backward frees the graph it ran through
        losses = batch_losses(causal_lm, batch[start:start + settings.batch], settings, readout,
                              None if log_scale is None else log_scale.exp(), bodies)
        torch.autograd.backward(torch.stack(losses).sum() / len(batch))
        step_loss += sum(float(loss.detach()) for loss in losses) / len(batch)
    if settings.clip > 0:
        torch.nn.utils.clip_grad_norm_(trainable, settings.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


def train(settings: FinetuneSettings, progress: bool = True) -> FinetuneResult:
    """Train, validate, write the adapter, the loss curve and the provenance into ``settings.out``."""
    torch.set_num_threads(settings.threads)
    device = settings.resolved_device()
    settings = replace(settings, precision=settings.resolved_precision(device))  # provenance records the one used
    out = settings.out or default_output()
    out.mkdir(parents=True, exist_ok=True)
    base_folder = settings.model or default_model_path()
    loaded = load_model(base_folder, dtype=settings.precision, device=device)
    base = {"name": loaded.identity.name, "revision": loaded.identity.revision,
            "tokenizer": loaded.identity.tokenizer}
    check_tokenizer(loaded.tokenizer, base_folder, settings)
    data = training_data(settings, loaded.tokenizer)
    data.examples = examples = [e.to(device) for e in data.examples]
    data.validation = [e.to(device) for e in data.validation]
    steps = math.ceil(len(examples) / settings.accumulation)
    log.info("%d training examples (%d steps × %d), %d validation prompts, ~%.0f tokens per prompt; %s on %s",
             len(examples), steps, settings.accumulation, len(data.validation),
             sum(e.tokens for e in examples[:64]) / min(64, len(examples)), settings.precision, device)

    readout = readout_id(loaded.tokenizer)
    peft_model = lora_model(loaded.model, settings)
    if settings.init_adapter is not None:
        data.init_adapter = warm_start(peft_model, settings.init_adapter, base_folder)
    causal_lm = peft_model.get_base_model()
    scorer_teacher = None
    if settings.teacher_model is not None:
        scorer_teacher = ScorerTeacher(settings.teacher_model, settings.precision, device)
        scorer_teacher.check_base(base["tokenizer"])
        data.teacher = {**data.teacher, "scorer": scorer_teacher.describe(settings.teacher_model_weight)}
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    bodies = None
    if device == "cpu" and settings.scorer == "late" and settings.body_cache_mib > 0:
        bodies = FrozenBodies(causal_lm, settings.body_cache_mib << 20)
        log.info("item bodies computed once through the %d frozen layers (--body-cache-mib %d)", bodies.frozen,
                 settings.body_cache_mib)
    # The served fusion's z-scores are unit-free; the softmax over them needs a temperature, learned (log scale).
    log_scale = torch.nn.Parameter(torch.tensor(1.0, device=device)) if settings.retrieval_weight > 0 else None
    optimizer = torch.optim.AdamW([*trainable, *([log_scale] if log_scale is not None else [])], lr=settings.lr,
                                  weight_decay=settings.weight_decay)
    curve = LossCurve()
    ema: float | None = None
    last: dict[str, float] | None = None
    last_scores: list[list[float]] = []
    started = time.perf_counter()
    done_steps = done_examples = 0
    bar = tqdm(total=steps, desc="finetune", unit="step", disable=not progress)
    peft_model.train()
    budget = settings.minutes * 60
    for step in range(steps):
        time_used = (time.perf_counter() - started) / budget
        if time_used >= 1.0:
            log.info("time budget of %.1f min spent after %d steps", settings.minutes, step)
            break
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * lr_factor(step, settings.warmup, steps, time_used=time_used)
        batch = examples[step * settings.accumulation:(step + 1) * settings.accumulation]
        if scorer_teacher is not None:
            batch = [taught(example, scorer_teacher, settings) for example in batch]
        step_loss = optimizer_step(causal_lm, optimizer, trainable, batch, settings, readout, log_scale, bodies)
        done_steps, done_examples = step + 1, done_examples + len(batch)
        ema = step_loss if ema is None else EMA * ema + (1 - EMA) * step_loss
        curve.steps.append(StepRecord(done_steps, done_examples, step_loss, ema,
                                      optimizer.param_groups[0]["lr"], time.perf_counter() - started))
        curve.write(out)
        bar.update()
        bar.set_postfix(loss=f"{ema:.3f}")
        if settings.val_every and done_steps % settings.val_every == 0 and done_steps < steps:
            last, last_scores = _validate(peft_model, causal_lm, data.validation, curve, done_steps, out, readout)
    bar.close()
    elapsed = time.perf_counter() - started
    if bodies is not None:
        log.info("item bodies: %d computed, %d read from the cache (%.0f MiB kept)", bodies.misses, bodies.hits,
                 bodies.nbytes / 2**20)
    if last is None or last["step"] != done_steps:
        last, last_scores = _validate(peft_model, causal_lm, data.validation, curve, done_steps, out, readout)
    save_adapter(peft_model, out, base["name"])
    fusion = data.split.get("retrieval_fusion")
    if log_scale is not None and isinstance(fusion, dict):
        fusion["learned_scale"] = round(float(log_scale.detach().exp()), 4)
    write_provenance(out, settings, base, data, curve, done_steps, done_examples, elapsed, last, device,
                     served_fusion(last_scores, data))
    log.info("adapter, curve and provenance written to %s (%.1f min)", out, elapsed / 60)
    return FinetuneResult(out, done_steps, done_examples, elapsed, last)


def _validate(peft_model: Any, causal_lm: Any, validation: Sequence[Example], curve: LossCurve, step: int,
              out: Path, readout: int) -> tuple[dict[str, float], list[list[float]]]:
    peft_model.eval()
    started = time.perf_counter()
    first_order: list[list[float]] = []
    result = evaluate(causal_lm, validation, readout, first_order)
    peft_model.train()
    result = {"step": float(step), **result, "seconds": time.perf_counter() - started}
    curve.validation.append(result)
    curve.write(out, png=True)
    log.info("validation at step %d: loss %.3f, HR@1 %.3f, HR@5 %.3f, NDCG@10 %.3f, max label share %.2f, "
             "position consistency %.2f%s", step, result["loss"], result["hr1"], result["hr5"], result["ndcg10"],
             result["max_label_share"], result.get("position_consistency", float("nan")),
             f" (fused with the retrieval stage's score; the model alone: HR@1 {result['alone_hr1']:.3f}, "
             f"NDCG@10 {result['alone_ndcg10']:.3f})" if "alone_hr1" in result else "")
    return result, first_order


def served_fusion(first_order: list[list[float]], data: TrainingData) -> dict[str, object]:
    """The provenance's ``served_fusion``: the retrieval stage's weight chosen on the final validation
    (:func:`kvshard.ranking.choose_fusion_weight`), which the merge hands to every server as the model's
    default ``retrieval_weight``."""
    targets = [int(example.targets[0]) for example in data.validation]
    choice = choose_fusion_weight(first_order, data.validation_stage, targets)
    log.info("served fusion: retrieval stage weight %g chosen on %d validation prompts (NDCG@10 %.3f; the model "
             "alone %.3f, the stage alone %.3f)", choice.weight, choice.prompts,
             choice.by_weight[choice.weight]["ndcg10"], choice.by_weight[0.0]["ndcg10"], choice.stage_alone["ndcg10"])
    return {**choice.as_json(), "set": "the final validation prompts' first candidate order; the stage's score "
            "leaves each prompt's own user out"}


def write_provenance(out: Path, settings: FinetuneSettings, base: dict[str, str], data: TrainingData,
                     curve: LossCurve, steps: int, examples: int, elapsed: float,
                     validation: dict[str, float], device: str = "cpu",
                     fusion: dict[str, object] | None = None) -> None:
    """``provenance.json``: how the adapter was made, and the base it must be merged into."""
    settings_record = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
    record = {
        "adapter": ADAPTER_WEIGHTS,
        "adapter_sha256": sha256_file(out / ADAPTER_WEIGHTS),
        "base": {"name": base["name"], "revision": base["revision"], "tokenizer": base["tokenizer"]},
        "command": settings.command(),
        "invoked_as": " ".join(sys.argv),
        "seed": settings.seed,
        "settings": settings_record,
        "dataset": data.dataset,
        "split": data.split,
        "teacher": data.teacher,
        "init_adapter": data.init_adapter,
        "steps": steps,
        "examples": examples,
        "training_seconds": round(elapsed, 1),
        "lineage_training_seconds": round(lineage_seconds(elapsed, data.init_adapter), 1),
        "seconds_per_example": round(elapsed / max(1, examples), 3),
        "examples_per_second": round(examples / max(elapsed, 1e-9), 3),
        "threads": settings.threads,
        "device": device_record(device, settings.batch),
        "versions": library_versions(),
        "loss_curve": {"json": "loss_curve.json", "png": "loss_curve.png",
                       "first_ema": curve.steps[0].loss_ema if curve.steps else None,
                       "last_ema": curve.steps[-1].loss_ema if curve.steps else None},
        "evaluation": {"validation": validation,
                       "note": "validation = training users' second-to-last interactions; "
                               "`kvshard bench recommender` reports held-out users' last interactions"},
        "served_fusion": fusion,
    }
    write_json_atomic(out / PROVENANCE_FILE, record)


def run(args: argparse.Namespace) -> int:
    """``kvshard model finetune``: train with the settings from flags/env; print the output folder."""
    result = train(from_args(args))
    print(f"{result.out}: {result.steps} steps, {result.examples} examples, {result.elapsed_s / 60:.1f} min, "
          f"validation HR@1 {result.validation['hr1']:.3f} (loss {result.validation['loss']:.3f})")
    return 0
