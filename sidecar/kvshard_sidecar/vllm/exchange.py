"""The pod-local KV exchange: how blended prompt KV travels from the sidecar to vLLM's worker.

The sidecar blends a prompt's KV, writes it here, then calls vLLM with the prompt's token ids; the
KV connector inside vLLM (:mod:`kvshard_sidecar.vllm.connector`) finds the entry by those same token ids,
copies it into vLLM's paged cache and tells the scheduler that all but the last prompt token are
already computed. The two sides share nothing but a folder, so this module must not import vLLM
(the sidecar image does not ship it) and both processes must agree on a key without talking:

* an entry's key is a blake2b hash of the prompt token ids (int64 little-endian bytes), never
  Python's ``hash()``, which differs per process;
* an entry is one safetensors file ``<key>.safetensors`` holding ``token_ids`` (int64), ``keys`` and
  ``values`` (``[layers, kv_heads, tokens, head_dim]``, keys rotated for their final positions, the
  model's dtype), with a BLAKE3 checksum over every tensor in its metadata (BLAKE3: the whole prompt
  KV is hashed on the request path twice, by the writer and by vLLM's worker, so speed matters);
* a writer publishes atomically (a hidden temporary file, then ``os.replace``), so a reader sees a
  whole entry or none; a reader that finds a corrupt or mismatching file treats it as absent;
* entries are removed once used, and anything older than the TTL (a crashed request, a sidecar that
  gave up) is swept, so the shared-memory folder cannot grow without bound.

The default folder is in ``/dev/shm`` so entries never touch a disk; any folder both processes can
reach works (tests use a temporary one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import blake3
import safetensors.torch
import torch

log = logging.getLogger(__name__)

DEFAULT_EXCHANGE_DIR = Path("/dev/shm/kvshard-exchange")
DEFAULT_TTL_SECONDS = 120.0
FORMAT_VERSION = "2"
SUFFIX = ".safetensors"

_KEY_SCHEME = b"kvshard-exchange-key-v1"
_CHECKSUM_SCHEME = b"kvshard-exchange-checksum-v2"
_TEMP_PREFIX = ".tmp-"
_MAX_HEADER_BYTES = 64 * 1024  # a three-tensor header is ~500 bytes; anything huge is garbage


def entry_key(token_ids: Sequence[int]) -> str:
    """The stable name of the entry for ``token_ids``: the same in every process and every run."""
    digest = hashlib.blake2b(_KEY_SCHEME, digest_size=20)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.hexdigest()


class KVExchange:
    """A folder of prompt-KV entries shared by the sidecar (writer) and vLLM's connector (reader).

    Every method is safe to call from several processes at once: writes are atomic renames, removes
    tolerate a file that is already gone, and a failed read is reported as a miss.
    """

    def __init__(self, directory: str | os.PathLike[str] = DEFAULT_EXCHANGE_DIR,
                 ttl_seconds: float = DEFAULT_TTL_SECONDS, file_mode: int = 0o644) -> None:
        """``file_mode``: vLLM and the sidecar may run as different users of one pod, so entries are
        world-readable by default; restrict the folder (or pass ``0o600``) where they share a user."""
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive, got {ttl_seconds}")
        self.directory = Path(directory)
        self.ttl_seconds = ttl_seconds
        self.file_mode = file_mode
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, token_ids: Sequence[int]) -> Path:
        return self.directory / f"{entry_key(token_ids)}{SUFFIX}"

    def write(self, token_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> Path:
        """Publish the prompt KV for ``token_ids``; replaces an older entry for the same prompt.

        ``keys`` and ``values`` are ``[layers, kv_heads, tokens, head_dim]`` with ``tokens`` at most
        ``len(token_ids)`` (the connector needs all but the last token; a full prompt is fine).
        """
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError(f"keys and values must share a [layers, kv_heads, tokens, head_dim] shape, "
                             f"got {tuple(keys.shape)} and {tuple(values.shape)}")
        if keys.dtype != values.dtype:
            raise ValueError(f"keys ({keys.dtype}) and values ({values.dtype}) must share a dtype")
        if not token_ids or keys.shape[2] > len(token_ids):
            raise ValueError(f"KV holds {keys.shape[2]} tokens for a prompt of {len(token_ids)} tokens")
        tensors = {
            "token_ids": torch.tensor(list(token_ids), dtype=torch.int64),
            "keys": keys.detach().to("cpu").contiguous(),
            "values": values.detach().to("cpu").contiguous(),
        }
        metadata = {
            "format_version": FORMAT_VERSION,
            "entry_key": entry_key(token_ids),
            "num_tokens": str(keys.shape[2]),
            "checksum_blake3": _checksum(tensors),
        }
        target = self.path_for(token_ids)
        fd, temp_name = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.directory)
        os.close(fd)
        try:
            safetensors.torch.save_file(tensors, temp_name, metadata=metadata)  # no in-memory copy
            os.chmod(temp_name, self.file_mode)
            os.replace(temp_name, target)
        except BaseException:
            _unlink(Path(temp_name))
            raise
        return target

    def lookup(self, token_ids: Sequence[int]) -> int:
        """How many tokens of KV the entry for ``token_ids`` holds; 0 when there is none.

        Reads only the header, so vLLM's scheduler can ask on every new request; the checksum is
        checked by :meth:`load`, which the worker calls before touching the paged cache.
        """
        path = self.path_for(token_ids)
        try:
            with path.open("rb") as handle:
                metadata = _read_metadata(handle.read(8 + _MAX_HEADER_BYTES))
        except (OSError, ValueError):
            return 0
        if metadata.get("entry_key") != entry_key(token_ids):
            return 0
        try:
            return int(metadata.get("num_tokens", "0"))
        except ValueError:
            return 0

    def load(self, token_ids: Sequence[int], *, consume: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The entry's ``(keys, values)``, or ``None`` if it is absent, corrupt or for other tokens.

        ``consume`` removes the entry once read (the normal single-reader case). A reader that is one
        of several (tensor-parallel workers each loading their heads) passes ``consume=False`` and
        leaves removal to whoever knows the request is over (:meth:`remove`).
        """
        path = self.path_for(token_ids)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            metadata = _read_metadata(data)
            tensors = safetensors.torch.load(data)
        except Exception as exc:  # safetensors raises its own error types for malformed bytes
            log.warning("kvshard exchange: unreadable entry %s (%s); treated as a miss", path.name, exc)
            return None
        if not _intact(metadata, tensors, token_ids):
            log.warning("kvshard exchange: corrupt or mismatching entry %s; treated as a miss", path.name)
            return None
        if consume:
            _unlink(path)
        return tensors["keys"], tensors["values"]

    def remove(self, token_ids: Sequence[int]) -> bool:
        """Remove the entry for ``token_ids``; ``False`` if there was none."""
        return _unlink(self.path_for(token_ids))

    def sweep(self, now: float | None = None) -> int:
        """Remove entries and abandoned temporary files older than the TTL; returns how many."""
        cutoff = (time.time() if now is None else now) - self.ttl_seconds
        removed = 0
        try:
            candidates = list(self.directory.iterdir())
        except OSError:
            return 0
        for path in candidates:
            if not (path.name.endswith(SUFFIX) or path.name.startswith(_TEMP_PREFIX)):
                continue
            try:
                stale = path.stat().st_mtime < cutoff
            except OSError:
                continue
            if stale and _unlink(path):
                removed += 1
        if removed:
            log.info("kvshard exchange: swept %d stale entries from %s", removed, self.directory)
        return removed

    def __len__(self) -> int:
        """Entries currently published (temporary files excluded)."""
        try:
            return sum(1 for p in self.directory.iterdir() if p.name.endswith(SUFFIX)
                       and not p.name.startswith(_TEMP_PREFIX))
        except OSError:
            return 0


def read_connector_stats(stats_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Sum the counter files that every :class:`~kvshard_sidecar.vllm.connector.KvshardConnector`
    instance (one per role and process) keeps under ``stats_dir`` (default ``<exchange>/stats``).

    Lives here, not in the connector, so the sidecar and tests can read them without vLLM.
    """
    totals: dict[str, int] = {}
    for path in sorted(Path(stats_dir).glob("*.json")):
        try:
            counters = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for name, value in counters.items():
            if isinstance(value, int) and name != "pid":
                totals[name] = totals.get(name, 0) + value
    return totals


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    """BLAKE3 over each tensor's name, dtype and shape and then its bytes, in name order."""
    digest = blake3.blake3(_CHECKSUM_SCHEME)
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        description = f"{name}\0{tensor.dtype}\0{','.join(map(str, tensor.shape))}\0".encode()
        digest.update(struct.pack("<I", len(description)) + description)
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file from its first bytes; ``ValueError`` if malformed."""
    if len(data) < 8:
        raise ValueError("too short for a safetensors header")
    (header_len,) = struct.unpack_from("<Q", data, 0)
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise ValueError(f"header length {header_len} does not fit")
    try:
        header = json.loads(data[8 : 8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable header: {exc}") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError("no kvshard exchange metadata")
    return {str(k): str(v) for k, v in metadata.items()}


def _intact(metadata: dict[str, str], tensors: dict[str, torch.Tensor], token_ids: Sequence[int]) -> bool:
    if set(tensors) != {"token_ids", "keys", "values"}:
        return False
    if metadata.get("entry_key") != entry_key(token_ids):
        return False
    if tensors["token_ids"].tolist() != list(token_ids):  # a hash collision must never be served
        return False
    keys, values = tensors["keys"], tensors["values"]
    if keys.shape != values.shape or keys.dim() != 4 or str(keys.shape[2]) != metadata.get("num_tokens"):
        return False
    return metadata.get("checksum_blake3") == _checksum(tensors)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
