"""``kvshard bench store``: put/get throughput of the block store's memory and disk tiers.

The numbers decide budgets and whether the disk tier is worth a lookup: a disk hit has to beat
recomputing the prefill, and a peer fetch (a later tier) has to beat the disk. Blocks are shaped
like SmolLM2-135M's KV (30 layers, 3 KV heads, head_dim 64, float32): one row set for a short item
block (16 tokens by default, ~737 KB) and one for a long block (512 tokens, e.g. a user history).

Disk ``put`` is encode + checksum + write + fsync + rename. Disk ``get`` runs on a fresh tier with
no memory tier in front, after dropping the files from the OS page cache (``posix_fadvise``), so
it is a cold read + verify + decode; ``get-cached`` repeats it with the files in the page cache.
MB/s counts the block's tensor bytes (``KVBlock.nbytes``), 1 MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from kvshard_sidecar.blockstore import DiskTier, KVBlock, MemoryTier

SMOLLM2_LAYERS = 30
SMOLLM2_KV_HEADS = 3
SMOLLM2_HEAD_DIM = 64
MEMORY_GET_ROUNDS = 20  # a memory hit takes microseconds; repeat so the timing means something

Row = dict[str, object]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvshard bench store``."""
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per item block (default 16)")
    parser.add_argument("--blocks", type=int, default=128, help="item blocks per measurement (default 128)")
    parser.add_argument(
        "--large-block-tokens", type=int, default=512, help="tokens per large block; 0 skips (default 512)"
    )
    parser.add_argument(
        "--large-blocks", type=int, default=8, help="large blocks per measurement (default 8)"
    )
    parser.add_argument(
        "--disk-root", type=Path, default=None, help="folder for the disk tier (default: a fresh temp folder)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")


def run(args: argparse.Namespace) -> list[Row]:
    """Measure every tier and operation, print a table, optionally write JSON; returns the rows."""
    item = smollm2_block(args.block_tokens)
    print(
        f"SmolLM2-135M item block ({args.block_tokens} tokens, float32, {SMOLLM2_LAYERS} layers x "
        f"{SMOLLM2_KV_HEADS} KV heads x head_dim {SMOLLM2_HEAD_DIM}, K+V): {item.nbytes:,} bytes "
        f"({item.nbytes / 1e6:.3f} MB; {item.nbytes // args.block_tokens:,} bytes/token)"
    )
    sizes = [(args.block_tokens, args.blocks)]
    if args.large_block_tokens > 0:
        sizes.append((args.large_block_tokens, args.large_blocks))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvshard-bench-store-") as scratch:
        root = Path(args.disk_root) if args.disk_root is not None else Path(scratch)
        for tokens, count in sizes:
            rows += bench_block_size(tokens, count, root / f"tokens-{tokens}")
    print(format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")
    return rows


def smollm2_block(tokens: int, seed: int = 0) -> KVBlock:
    """A random block with SmolLM2-135M's KV shape and dtype."""
    generator = torch.Generator().manual_seed(seed)
    shape = (SMOLLM2_LAYERS, SMOLLM2_KV_HEADS, tokens, SMOLLM2_HEAD_DIM)
    return KVBlock(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))


def bench_block_size(tokens: int, count: int, root: Path) -> list[Row]:
    """Rows for memory put/get and disk put/get/get-cached with ``count`` blocks of ``tokens``."""
    blocks = [smollm2_block(tokens, seed=n) for n in tqdm(range(count), desc=f"make {tokens}-token blocks")]
    keys = [f"{tokens:08x}{n:056x}" for n in range(count)]
    block_bytes = blocks[0].nbytes
    budget = 2 * block_bytes * count + 2**20

    memory = MemoryTier(budget)
    rows = [_measure("memory", "put", block_bytes, count, lambda i: memory.put(keys[i], blocks[i]))]
    ops = count * MEMORY_GET_ROUNDS
    rows.append(_measure("memory", "get", block_bytes, ops, lambda i: memory.get(keys[i % count])))

    with DiskTier(root, budget) as writer:
        rows.append(_measure("disk", "put", block_bytes, count, lambda i: writer.put(keys[i], blocks[i])))
    with DiskTier(root, budget) as reader:  # a fresh tier: nothing of the writes is held in memory
        for key in keys:
            _drop_from_page_cache(reader.path_for(key))
        rows.append(_measure("disk", "get", block_bytes, count, lambda i: _must(reader.get(keys[i]))))
        rows.append(_measure("disk", "get-cached", block_bytes, count, lambda i: _must(reader.get(keys[i]))))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    lines = [f"{'tier':<7} {'op':<11} {'block bytes':>12} {'blocks':>7} {'seconds':>9} {'MB/s':>10}"]
    for row in rows:
        lines.append(
            f"{row['tier']!s:<7} {row['op']!s:<11} {row['block_bytes']:>12,} {row['blocks']:>7} "
            f"{row['seconds']:>9.4f} {row['mb_per_s']:>10,.1f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Run without the ``kvshard`` CLI: ``python -m kvshard_bench.store``."""
    parser = argparse.ArgumentParser(prog="kvshard bench store", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))


def _measure(tier: str, op: str, block_bytes: int, ops: int, step: Callable[[int], object]) -> Row:
    started = time.perf_counter()
    for index in tqdm(range(ops), desc=f"{tier} {op}", unit="block", leave=False, mininterval=0.5):
        step(index)
    seconds = max(time.perf_counter() - started, 1e-9)
    return {
        "tier": tier,
        "op": op,
        "block_bytes": block_bytes,
        "blocks": ops,
        "seconds": round(seconds, 6),
        "mb_per_s": round(block_bytes * ops / 1e6 / seconds, 1),
    }


def _must(block: KVBlock | None) -> KVBlock:
    if block is None:
        raise RuntimeError("a block written by the benchmark was not read back")
    return block


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
