"""The pod-local KV exchange: round trips, refuses corrupt or foreign entries, sweeps stale ones."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvshard_sidecar.vllm.exchange import KVExchange, entry_key, read_connector_stats

PROMPT = [1, 9690, 198, 2683, 314, 253, 6082, 42, 7]


def kv(tokens: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (3, 2, tokens, 8)  # layers, kv_heads, tokens, head_dim
    return (torch.randn(shape, generator=generator).to(dtype),
            torch.randn(shape, generator=generator).to(dtype))


@pytest.fixture
def exchange(tmp_path: Path) -> KVExchange:
    return KVExchange(tmp_path / "exchange", ttl_seconds=60)


def test_round_trip_returns_the_same_tensors_and_consumes_the_entry(exchange: KVExchange) -> None:
    keys, values = kv(len(PROMPT) - 1)
    exchange.write(PROMPT, keys, values)
    assert exchange.lookup(PROMPT) == len(PROMPT) - 1
    loaded = exchange.load(PROMPT)
    assert loaded is not None
    assert torch.equal(loaded[0], keys) and torch.equal(loaded[1], values)
    assert exchange.lookup(PROMPT) == 0 and exchange.load(PROMPT) is None and len(exchange) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_keeps_the_model_dtype(exchange: KVExchange, dtype: torch.dtype) -> None:
    keys, values = kv(len(PROMPT), dtype=dtype)
    exchange.write(PROMPT, keys, values)
    loaded = exchange.load(PROMPT, consume=False)
    assert loaded is not None and loaded[0].dtype == dtype and torch.equal(loaded[1], values)
    assert exchange.lookup(PROMPT) == len(PROMPT)  # not consumed


def test_other_prompts_miss(exchange: KVExchange) -> None:
    exchange.write(PROMPT, *kv(4))
    assert exchange.lookup(PROMPT[:-1]) == 0
    assert exchange.load(PROMPT + [5]) is None
    assert exchange.lookup(list(reversed(PROMPT))) == 0


def test_rewrite_replaces_the_entry(exchange: KVExchange) -> None:
    exchange.write(PROMPT, *kv(4, seed=1))
    keys, values = kv(4, seed=2)
    exchange.write(PROMPT, keys, values)
    loaded = exchange.load(PROMPT)
    assert loaded is not None and torch.equal(loaded[0], keys)
    assert len(exchange) == 0


@pytest.mark.parametrize("position", [0, 7, 100, -1, -1000])
def test_a_flipped_byte_is_a_miss_never_served(exchange: KVExchange, position: int) -> None:
    path = exchange.write(PROMPT, *kv(8))
    data = bytearray(path.read_bytes())
    data[position] ^= 0x5A
    path.write_bytes(bytes(data))
    assert exchange.load(PROMPT) is None


def test_a_truncated_or_garbage_file_is_a_miss(exchange: KVExchange) -> None:
    path = exchange.write(PROMPT, *kv(8))
    path.write_bytes(path.read_bytes()[:-10])
    assert exchange.load(PROMPT) is None
    path.write_bytes(b"not a safetensors file")
    assert exchange.lookup(PROMPT) == 0 and exchange.load(PROMPT) is None


def test_an_entry_renamed_to_another_prompt_is_a_miss(exchange: KVExchange) -> None:
    """A file under the wrong name (or a hash collision) must not serve another prompt's KV."""
    other = [5, 6, 7, 8, 9]
    exchange.write(other, *kv(4)).rename(exchange.path_for(PROMPT))
    assert exchange.lookup(PROMPT) == 0 and exchange.load(PROMPT) is None


def test_write_refuses_inconsistent_kv(exchange: KVExchange) -> None:
    keys, values = kv(4)
    with pytest.raises(ValueError, match="shape"):
        exchange.write(PROMPT, keys, values[:, :, :3])
    with pytest.raises(ValueError, match="dtype"):
        exchange.write(PROMPT, keys, values.double())
    with pytest.raises(ValueError, match="tokens"):
        exchange.write(PROMPT[:3], keys, values)
    assert len(exchange) == 0 and not list(exchange.directory.iterdir())


def test_remove_is_idempotent(exchange: KVExchange) -> None:
    exchange.write(PROMPT, *kv(4))
    assert exchange.remove(PROMPT) is True
    assert exchange.remove(PROMPT) is False


def test_sweep_removes_only_entries_older_than_the_ttl(exchange: KVExchange) -> None:
    old, fresh = [1, 2, 3], [4, 5, 6]
    old_path = exchange.write(old, *kv(2))
    exchange.write(fresh, *kv(2))
    abandoned = exchange.directory / ".tmp-abandoned"
    abandoned.write_bytes(b"half a write")
    past = time.time() - 3600
    os.utime(old_path, (past, past))
    os.utime(abandoned, (past, past))
    (exchange.directory / "stats").mkdir()  # the connector's counters are never swept
    assert exchange.sweep() == 2
    assert exchange.lookup(old) == 0 and exchange.lookup(fresh) == 2
    assert not abandoned.exists() and (exchange.directory / "stats").is_dir()
    assert exchange.sweep(now=time.time() + 3600) == 1 and len(exchange) == 0


def test_keys_are_stable_across_processes() -> None:
    """Python's hash() is salted per process; the sidecar and vLLM must agree on names."""
    here = entry_key(PROMPT)
    code = f"from kvshard_sidecar.vllm.exchange import entry_key; print(entry_key({PROMPT!r}))"
    there = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert here == there and len(here) == 40
    assert entry_key(PROMPT) != entry_key(PROMPT[:-1]) != entry_key([])
    assert entry_key([1, 2]) != entry_key([2, 1]) and entry_key([256]) != entry_key([1, 0])


def test_entries_are_readable_by_another_user_of_the_pod(exchange: KVExchange) -> None:
    path = exchange.write(PROMPT, *kv(2))
    assert path.stat().st_mode & 0o777 == 0o644


def test_connector_stats_are_summed_over_instances(tmp_path: Path) -> None:
    (tmp_path / "scheduler-1.json").write_text('{"role": "scheduler", "pid": 1, "external_tokens": 178}')
    (tmp_path / "worker-2.json").write_text('{"role": "worker", "pid": 2, "loads": 1, "tokens_loaded": 178}')
    (tmp_path / "worker-3.json").write_text('{"role": "worker", "pid": 3, "loads": 2}')
    (tmp_path / "torn.json").write_text('{"loads": ')
    assert read_connector_stats(tmp_path) == {"external_tokens": 178, "loads": 3, "tokens_loaded": 178}
