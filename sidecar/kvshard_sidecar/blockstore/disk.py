"""The disk tier: encoded blocks as files under a byte budget, shared by every sidecar on the node.

Layout: ``root/<key[:2]>/<key>.safetensors`` (the two-character fan-out keeps folders small).
Keys are validated before they become paths, so nothing can escape ``root``.

Several sidecar processes may share one folder, so:

* a write goes to a temp file in the target's folder, is fsynced, then ``os.replace``-d into place:
  readers see the old file or the new one, never a torn one, and concurrent writers of one key
  leave exactly one valid file (the last rename wins; all of them are complete);
* every change to the *set* of files (commit, eviction, removal) happens under an ``fcntl.flock``
  on ``root/.lock``, which also holds the folder's byte and entry totals, so the budget is honoured
  across processes without rescanning the folder on every put;
* reads take no lock: they open the file (an unlink or rename never disturbs an open file), verify
  it, and bump its mtime, which is the LRU clock that eviction sorts by.

A file that fails verification (flipped byte, truncation, garbage) is a miss counted as
``corrupt`` and is removed, unless another process has meanwhile replaced it with a fresh file.
The totals in ``.lock`` are recounted from the folder when a tier opens and on every eviction
pass, so a process that died between a rename and its bookkeeping cannot skew them for long.
"""

from __future__ import annotations

import fcntl
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from kvshard.segments import is_block_key
from kvshard_sidecar.blockstore.block import KVBlock
from kvshard_sidecar.blockstore.codec import CorruptBlockError, decode_block, encode_block, verify_block
from kvshard_sidecar.blockstore.stats import TierStats

SUFFIX = ".safetensors"
_TEMP_SUFFIX = ".tmp"
_USAGE = struct.Struct("<QQ")  # bytes, entries: stored in the lock file itself
_STALE_TEMP_SECONDS = 3600  # temp files this old belong to a writer that died


T = TypeVar("T")


class DiskTier:
    """Blocks stored as verified safetensors files under ``root``, at most ``budget_bytes`` of them.

    When a put goes over budget, least-recently-used files are removed until the folder is at
    ``low_water`` × budget: evicting in batches keeps a full folder from being rescanned on every
    put (``1.0`` evicts only what the new file needs).
    """

    def __init__(self, root: Path, budget_bytes: int, low_water: float = 0.9) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        if not 0.0 < low_water <= 1.0:
            raise ValueError("low_water must be in (0, 1]")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.low_water = low_water
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        self._folder_lock = threading.Lock()  # flock is per open file, so threads need their own lock
        self._counter_lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._corrupt = 0
        with self._locked():
            self._write_usage(*self._recount())

    # -- lookups ------------------------------------------------------------------------------

    def get(self, key: str) -> KVBlock | None:
        """The verified block for ``key``, or ``None`` (a miss; a corrupt file is also removed)."""
        # The fresh buffer becomes the tensors' own: no copy.
        return self._read_checked(key, lambda data: decode_block(key, data, copy=False))

    def read_bytes(self, key: str) -> bytes | None:
        """The verified encoded block for ``key`` (what a peer is sent), or ``None``."""
        return self._read_checked(key, lambda data: _checked(key, data, bytes(data)))

    def verified_path(self, key: str) -> Path | None:
        """The file of ``key`` once its contents checked out (for ``sendfile`` to a peer), or ``None``."""
        path = self.path_for(key)
        return self._read_checked(key, lambda data: _checked(key, data, path))

    def _read_checked(self, key: str, use: Callable[[bytearray], T]) -> T | None:
        """Read ``key``'s file and hand it to ``use``; a miss or a corrupt file (removed) gives ``None``."""
        path = self.path_for(key)
        read = _read_file(path)
        if read is None:
            self._count(misses=1)
            return None
        data, inode = read
        try:
            result = use(data)
        except CorruptBlockError:
            self._drop_corrupt(path, inode)
            return None
        self._touch(path)
        self._count(hits=1)
        return result

    def contains(self, key: str) -> bool:
        """Whether a file for ``key`` exists (unverified, uncounted, LRU order unchanged)."""
        return self.path_for(key).is_file()

    def keys(self) -> Iterator[str]:
        """Every key with a file in the folder (written by any process), in no particular order."""
        for path, _ in self._files():
            yield path.name[: -len(SUFFIX)]

    # -- changes --------------------------------------------------------------------------------

    def put(self, key: str, block: KVBlock) -> bool:
        """Write ``block`` atomically; ``False`` if its file alone would exceed the budget."""
        path = self.path_for(key)
        data = encode_block(key, block)
        if len(data) > self.budget_bytes:
            return False
        path.parent.mkdir(exist_ok=True)
        fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=_TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as temp:
                temp.write(data)
                temp.flush()
                os.fsync(temp.fileno())
            with self._locked():
                used, entries = self._read_usage()
                old_size = _size_or_none(path)
                os.replace(temp_name, path)
                now = time.time_ns()  # explicit: kernel mtimes tick too coarsely to order puts
                os.utime(path, ns=(now, now))
                used += len(data) - (old_size or 0)
                entries += 1 if old_size is None else 0
                if used > self.budget_bytes:
                    used, entries = self._evict_to_low_water(keep=path)
                self._write_usage(used, entries)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        return True

    def evict(self, key: str) -> bool:
        """Remove ``key``'s file; ``True`` if there was one. Not counted as an eviction."""
        path = self.path_for(key)
        with self._locked():
            size = _size_or_none(path)
            if size is None:
                return False
            path.unlink(missing_ok=True)
            used, entries = self._read_usage()
            self._write_usage(max(used - size, 0), max(entries - 1, 0))
            return True

    def stats(self) -> TierStats:
        """This tier's counters; ``bytes`` and ``entries`` are the whole folder's (all processes)."""
        with self._locked():
            used, entries = self._read_usage()
        with self._counter_lock:
            return TierStats(
                hits=self._hits,
                misses=self._misses,
                bytes=used,
                evictions=self._evictions,
                corrupt=self._corrupt,
                entries=entries,
            )

    def path_for(self, key: str) -> Path:
        """Where ``key``'s file lives; ``ValueError`` unless ``key`` is a block key."""
        if not is_block_key(key):
            raise ValueError(f"not a block key: {key!r}")
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._folder_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_usage(self) -> tuple[int, int]:
        raw = os.pread(self._lock_fd, _USAGE.size, 0)
        if len(raw) != _USAGE.size:
            return self._recount()
        used, entries = _USAGE.unpack(raw)
        return int(used), int(entries)

    def _write_usage(self, used: int, entries: int) -> None:
        os.pwrite(self._lock_fd, _USAGE.pack(used, entries), 0)

    def _recount(self) -> tuple[int, int]:
        sizes = [stat.st_size for _, stat in self._files(clean_stale=True)]
        return sum(sizes), len(sizes)

    def _evict_to_low_water(self, keep: Path) -> tuple[int, int]:
        """Remove least-recently-used files (never ``keep``) until under the low-water mark."""
        files = sorted(self._files(clean_stale=True), key=lambda f: (f[1].st_mtime_ns, f[0].name))
        used, entries = sum(stat.st_size for _, stat in files), len(files)
        target = int(self.budget_bytes * self.low_water)
        for path, stat in files:
            if used <= target:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            used -= stat.st_size
            entries -= 1
            self._count(evictions=1)
        return used, entries

    def _files(self, clean_stale: bool = False) -> Iterator[tuple[Path, os.stat_result]]:
        stale_before = time.time() - _STALE_TEMP_SECONDS
        for shard in os.scandir(self.root):
            if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                name = entry.name
                if name.endswith(SUFFIX) and is_block_key(name[: -len(SUFFIX)]):
                    yield Path(entry.path), stat
                elif clean_stale and name.endswith(_TEMP_SUFFIX) and stat.st_mtime < stale_before:
                    Path(entry.path).unlink(missing_ok=True)

    def _drop_corrupt(self, path: Path, inode: tuple[int, int]) -> None:
        """Remove the corrupt file we read, unless it has since been replaced by a new one.

        The totals are recounted: a damaged file's size says nothing about what was accounted.
        """
        self._count(misses=1, corrupt=1)
        with self._locked():
            try:
                current = os.stat(path)
            except FileNotFoundError:
                return
            if (current.st_dev, current.st_ino) != inode:
                return
            path.unlink(missing_ok=True)
            self._write_usage(*self._recount())

    def _touch(self, path: Path) -> None:
        now = time.time_ns()
        try:
            os.utime(path, ns=(now, now))
        except FileNotFoundError:  # evicted while we read it; the block we hold is still valid
            pass

    def _count(self, hits: int = 0, misses: int = 0, evictions: int = 0, corrupt: int = 0) -> None:
        with self._counter_lock:
            self._hits += hits
            self._misses += misses
            self._evictions += evictions
            self._corrupt += corrupt


def _read_file(path: Path) -> tuple[bytearray, tuple[int, int]] | None:
    """The file's bytes in a fresh buffer and its (device, inode), or ``None`` if it is absent."""
    try:
        file = open(path, "rb", buffering=0)
    except FileNotFoundError:
        return None
    with file:
        stat = os.fstat(file.fileno())
        data = bytearray(stat.st_size)
        view, filled = memoryview(data), 0
        while filled < len(data):
            count = file.readinto(view[filled:])
            if not count:
                break
            filled += count
        del view
        del data[filled:]  # a short read can only mean damage; verification will reject it
    return data, (stat.st_dev, stat.st_ino)


def _size_or_none(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _checked(key: str, data: bytearray, result: T) -> T:
    """``result``, once ``data`` verifies as an intact encoding of block ``key``."""
    verify_block(key, data)
    return result
