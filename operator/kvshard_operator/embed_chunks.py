"""Content-addressed embedding chunks: the unit of work of an embedding Job, and the cache that makes a
rerun embed nothing (issue 19).

The operator embeds ~117 items/s on two cores, so a million-item catalog is embedded by many
workers (an Indexed Job in a cluster, processes locally), and only what was never embedded before:

* an item's **key** is a hash of the model fingerprint and its text (the vector depends on nothing
  else), so an unchanged item of a new catalog version, or a renamed one, is already done;
* the keys not in the cache are sorted and cut into chunks of :data:`CHUNK_ITEMS`; a chunk's
  **address** is the hash of its keys, so the same work always has the same name, and a worker that
  finds its output already there does nothing;
* a **plan** lists the chunk addresses in Job-index order; its id (a hash of the list) names the Job.
  The plan in force for a catalog (the hash of all its keys) is recorded and kept until each of its
  chunks is written, so chunks written meanwhile change neither the plan nor the Job's name: one Job
  per catalog, not one per poll (re-planning then would cut the remaining work into a new Job that
  duplicates what the first one still runs).

Where: a shared volume (a ReadWriteMany PVC) mounted by the operator and every Job pod at
``root``. etcd is too small (8 GB in all, 1.5 MB a value: a million 384-d float16 vectors is 768 MB);
an engine pod's cache belongs to serving — it is evicted, scaled in and out, and would need an API
of its own to be read back — while files on a shared volume outlive both the Job and the operator's
restarts, and the operator reads them a chunk at a time. Layout under ``root/<model>/``:
``inputs/<address>.json`` (keys and texts, written by the operator), ``chunks/<address>.npz`` (keys
and float16 unit vectors, written by a worker under a temporary name and renamed, so a chunk is
either whole or absent), ``plans/<id>.json``, ``catalogs/<hash>.json`` (a catalog's plan in force).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

CHUNK_ITEMS = 1024
"""Items per chunk: ~9 s of one worker at 117 items/s — long enough that starting a pod is small
beside it, short enough that a failed pod loses little."""

Encode = Callable[[Sequence[str]], npt.NDArray[np.float32]]
KEY_DTYPE = "S32"


def item_key(fingerprint: str, text: str) -> str:
    """The cache key of one item's vector under one model."""
    return hashlib.blake2b(fingerprint.encode() + b"\x00" + text.encode(), digest_size=16).hexdigest()


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chunks still to embed for one catalog, in Job-index order (empty: nothing to do)."""

    fingerprint: str
    addresses: tuple[str, ...]
    items: int

    @property
    def id(self) -> str:
        return hashlib.blake2b("\n".join(self.addresses).encode(), digest_size=6).hexdigest()


class ChunkStore:
    """The files of one model's chunks under ``root`` (the shared volume)."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.folder = Path(root) / hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()

    def _path(self, kind: str, name: str, suffix: str) -> Path:
        return self.folder / kind / f"{name}{suffix}"

    def output(self, address: str) -> Path:
        return self._path("chunks", address, ".npz")

    def done(self, addresses: Sequence[str]) -> int:
        """How many of ``addresses`` have their vectors written."""
        return sum(1 for a in addresses if self.output(a).exists())

    def cached_keys(self) -> set[str]:
        keys: set[str] = set()
        for path in sorted((self.folder / "chunks").glob("*.npz")):
            with np.load(path, allow_pickle=False) as doc:
                keys.update(k.decode() for k in doc["keys"].tolist())
        return keys

    def plan(self, texts: Sequence[str], chunk_items: int = CHUNK_ITEMS) -> Plan:
        """Chunks of the items whose key is not cached yet; writes their inputs and the plan file.
        The catalog's recorded plan while some of its chunks are still missing (a stable Job)."""
        every: dict[str, str] = {}
        for text in texts:
            every.setdefault(item_key(self.fingerprint, text), text)
        digest = hashlib.blake2b(f"{chunk_items}\n".encode() + "\n".join(sorted(every)).encode(),
                                 digest_size=16).hexdigest()
        record = self._path("catalogs", digest, ".json")
        if record.exists():
            doc = json.loads(record.read_text())
            recorded = Plan(self.fingerprint, tuple(doc["chunks"]), int(doc["items"]))
            if self.done(recorded.addresses) < len(recorded.addresses):
                return recorded
        cached = self.cached_keys()
        todo = {key: text for key, text in every.items() if key not in cached}
        keys = sorted(todo)
        addresses = []
        for start in range(0, len(keys), chunk_items):
            part = keys[start:start + chunk_items]
            address = hashlib.blake2b("\n".join(part).encode(), digest_size=16).hexdigest()
            addresses.append(address)
            _write_json(self._path("inputs", address, ".json"), {"keys": part, "texts": [todo[k] for k in part]})
        plan = Plan(self.fingerprint, tuple(addresses), len(keys))
        if addresses:
            _write_json(self._path("plans", plan.id, ".json"), {"fingerprint": self.fingerprint,
                                                                "chunks": addresses})
        _write_json(record, {"chunks": addresses, "items": len(keys)}, replace=True)
        return plan

    def run_chunk(self, plan_id: str, index: int, encode: Encode) -> int:
        """What one Job pod (or local worker) does: embed chunk ``index`` of the plan; 0 when its
        vectors are already there (a retried or repeated index embeds nothing)."""
        doc = json.loads(self._path("plans", plan_id, ".json").read_text())
        address = doc["chunks"][index]
        out = self.output(address)
        if out.exists():
            return 0
        work = json.loads(self._path("inputs", address, ".json").read_text())
        vectors = encode(work["texts"])
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, keys=np.array(work["keys"], dtype=KEY_DTYPE), vectors=vectors.astype(np.float16))
        tmp.replace(out)
        return len(work["keys"])

    def assemble(self, texts: Sequence[str]) -> npt.NDArray[np.float16]:
        """The catalog's vectors (row ``i`` for ``texts[i]``) from the chunk files; KeyError names how
        many are missing."""
        wanted = np.array([item_key(self.fingerprint, t) for t in texts], dtype=KEY_DTYPE)
        keys: list[npt.NDArray[np.bytes_]] = []
        parts: list[npt.NDArray[np.float16]] = []
        for path in sorted((self.folder / "chunks").glob("*.npz")):
            with np.load(path, allow_pickle=False) as doc:
                keys.append(doc["keys"])
                parts.append(doc["vectors"].astype(np.float16))
        if not keys:
            raise KeyError(f"{len(texts)} item vectors missing")
        all_keys = np.concatenate(keys)
        order = np.argsort(all_keys, kind="stable")
        at = np.minimum(np.searchsorted(all_keys[order], wanted), len(order) - 1)
        found = all_keys[order][at] == wanted
        if not found.all():
            raise KeyError(f"{int((~found).sum())} item vectors missing")
        out: npt.NDArray[np.float16] = np.concatenate(parts)[order[at]]
        return out


def _write_json(path: Path, doc: object, replace: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not replace:  # content-addressed: the same name always holds the same content
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)
