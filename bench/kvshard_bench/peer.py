"""``kvshard bench peer``: block fetch from a real peer sidecar over loopback HTTP (MB/s).

A real ``kvshard sidecar serve`` process is started on a disk folder pre-filled with blocks shaped
like SmolLM2's KV; this process then fetches them through the peer tier's own client
(:class:`~kvshard_sidecar.blockstore.peers.PeerFetcher`: HTTP GET, checksum verify, decode), side by side with a
local disk-tier read of the same blocks. The sidecar need not finish loading its model: block
serving does not wait for it, but the bench does, so the model load does not compete for the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvshard.processes import ManagedProcess
from kvshard_bench.store import format_table, smollm2_block
from kvshard_local.testing_servers import free_port
from kvshard_sidecar.blockstore import DiskTier
from kvshard_sidecar.blockstore.peers import PeerFetcher, static_holders

Row = dict[str, object]
TOKEN = "bench-peer-token"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[16, 512, 2048],
                        help="block sizes in tokens (default: 16 512 2048)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per size (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="fetch rounds per size (default 5)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")


def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvshard-bench-peer-") as scratch:
        root = Path(scratch)
        disk = DiskTier(root / "peer" / "blocks", budget_bytes=64 << 30)
        sizes: dict[int, list[str]] = {}
        for tokens in args.block_tokens:
            keys = [f"{tokens:08x}{index:056x}" for index in range(args.blocks)]
            for index, key in enumerate(keys):
                disk.put(key, smollm2_block(tokens, seed=index))
            sizes[tokens] = keys
        port = free_port()
        command = [sys.executable, "-m", "kvshard.cli", "--log-level", "WARNING", "sidecar", "serve",
                   "--port", str(port), "--disk-dir", str(root / "peer" / "blocks"), "--memory-bytes", "0"]
        peer = ManagedProcess(command, root / "peer.log", f"http://127.0.0.1:{port}/readyz",
                              env={**os.environ, "KVSHARD_SIDECAR_PEER_TOKEN": TOKEN})
        with peer:
            fetch = PeerFetcher(static_holders([f"http://127.0.0.1:{port}"]), TOKEN, timeout_seconds=30)
            for tokens, keys in sizes.items():
                block_bytes = smollm2_block(tokens).nbytes
                for tier, get in (("peer", fetch), ("disk", disk.get)):
                    seconds = []
                    for _ in tqdm(range(args.rounds), desc=f"{tier} {tokens} tokens", unit="round", leave=False):
                        started = time.perf_counter()
                        for key in keys:
                            if get(key) is None:
                                raise RuntimeError(f"block {key} missing from the {tier} tier")
                        seconds.append(time.perf_counter() - started)
                    best = statistics.median(seconds)
                    rows.append({"tier": tier, "op": "get", "block_tokens": tokens, "block_bytes": block_bytes,
                                 "blocks": len(keys), "seconds": round(best, 4),
                                 "mb_per_s": round(block_bytes * len(keys) / best / 1e6, 1)})
        disk.close()
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows
