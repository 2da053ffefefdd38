"""One embedding worker: ``python -m kvshard_operator.embed_worker --root R --plan P`` embeds the chunk
at its Job index (``$JOB_COMPLETION_INDEX``, set by Kubernetes in an Indexed Job's pods) and exits.

The same entry point runs in an embedding Job's pods and as a local process (``local/kvshard_local``), so
the local cluster exercises exactly the code a cluster runs. A retried index whose chunk is already
written embeds nothing (:meth:`embed_chunks.ChunkStore.run_chunk`).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from kvshard.settings import environment
from kvshard_operator import embedding
from kvshard_operator.embed_chunks import ChunkStore

FINGERPRINT = f"{embedding.MODEL_NAME}/{embedding.DIMENSION}"
"""The model every chunk key is computed under (the operator and the workers must agree)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvshard-embed-worker", description=__doc__)
    parser.add_argument("--root", type=Path, required=True, help="the shared volume's mount path")
    parser.add_argument("--plan", required=True, help="the plan id (the Job's kvshard.io/embedding-plan label)")
    parser.add_argument("--index", type=int, default=None, help="chunk index (default $JOB_COMPLETION_INDEX)")
    args = parser.parse_args(argv)
    index = args.index if args.index is not None else environment().job_completion_index
    if index is None:
        parser.error("no --index and no $JOB_COMPLETION_INDEX (Kubernetes sets it in an Indexed Job's pods)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    started = time.perf_counter()
    model = embedding.MiniLM()
    done = ChunkStore(args.root, FINGERPRINT).run_chunk(args.plan, index, model.encode)
    logging.info("chunk %d of plan %s: %d items embedded in %.1f s", index, args.plan, done,
                 time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
