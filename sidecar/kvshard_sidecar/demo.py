"""``kvshard sidecar demo``: the embedded default end to end in one process.

Prepares SmolLM2, loads a dataset, prefills the item and user-history blocks that a sample of
recommendation requests needs into the block store (memory + disk), prints the store's statistics
and one prompt with its segment boundaries, then serves that prompt blended from the store and
compares it with a full prefill: TTFT and the first token of both.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from kvshard.datasets import load_dataset
from kvshard.models import model_template
from kvshard.paths import cache_dir
from kvshard.prompts import PromptBuilder, RecommendationPrompt, sample_requests
from kvshard.segments import Prompt
from kvshard_sidecar.blockstore import BlockStore
from kvshard_sidecar.engine.blend import BlendEngine
from kvshard_sidecar.engine.model import load_model, prepare_smollm2
from kvshard_sidecar.engine.settings import BlendSettings

GiB = 1 << 30


def describe_prompt(built: RecommendationPrompt, tokenizer: object, width: int = 60) -> str:
    """One line per segment: token span, kind and (shortened) text."""
    lines = []
    for span in built.prompt.spans:
        text = span.segment.text.replace("\n", "⏎")
        if len(text) > width:
            text = text[: width - 1] + "…"
        lines.append(f"  [{span.start:5d}, {span.end:5d})  {span.segment.kind.value:<11} {text}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    model_path = args.model or prepare_smollm2()
    dataset = load_dataset(args.dataset)
    print(f"dataset {dataset.name}: {len(dataset.items)} items, {len(dataset.histories)} users, "
          f"{dataset.num_interactions} interactions")
    loaded = load_model(model_path)
    print(f"model {loaded.identity.name} ({loaded.config.num_hidden_layers} layers) from {loaded.path}")

    store_dir: Path = args.store_dir or cache_dir() / "demo" / "blocks"
    store = BlockStore(memory_bytes=2 * GiB, disk_root=store_dir, disk_bytes=8 * GiB)
    engine = BlendEngine(loaded.model, loaded.identity, store, BlendSettings())
    builder = PromptBuilder(loaded.tokenizer, dataset, template=model_template(loaded.path))
    requests = sample_requests(dataset, args.users, args.history, args.candidates, seed=args.seed)
    built = [builder.build(r) for r in requests]

    computed = 0
    units = [(b.prompt.segments[0], s) for b in built for s in b.prompt.segments[1:-1]]
    for system, segment in tqdm(units, desc="prefill blocks", unit="segment"):
        computed += sum(engine.ensure_blocks(Prompt.of([system, segment])).values())
    print(f"\nprefilled {computed} new tokens; blocks are stored in {store_dir} (a second run reuses them)")
    print("block store:")
    for tier, stats in store.stats().items():
        print(f"  {tier:<7} entries={stats.entries:<5} bytes={stats.bytes:<11} hits={stats.hits:<5} "
              f"misses={stats.misses:<5} evictions={stats.evictions} corrupt={stats.corrupt}")

    example = built[0]
    print(f"\nexample prompt (user {example.request.user_id}, {len(example.prompt)} tokens, "
          f"{len(example.prompt.segments)} segments):")
    print(describe_prompt(example, loaded.tokenizer))

    blended = engine.blend(example.prompt)
    full = engine.full(example.prompt)
    first_blended = int(blended.logits.argmax())
    first_full = int(full.logits.argmax())
    print(f"\nfull prefill:  TTFT {full.ttft_s * 1000:8.1f} ms  first token {loaded.tokenizer.decode([first_full])!r}")
    print(f"blended ({engine.settings.selector}, r={engine.settings.ratio}): TTFT {blended.ttft_s * 1000:8.1f} ms  "
          f"first token {loaded.tokenizer.decode([first_blended])!r}  "
          f"recomputed {blended.recompute_ratio:.1%} of tokens  "
          f"speedup {full.ttft_s / blended.ttft_s:.1f}x")
    target = example.target_index
    print(f"held-out item: {example.labels[target] if target is not None else '-'}")
    store.close()
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")
    return 0
