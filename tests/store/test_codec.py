"""The codec: bit-exact round trips, and every kind of damage is refused."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import bit_equal, make_block, make_key

from kvshard_sidecar.blockstore import CorruptBlockError, KVBlock, decode_block, encode_block, verify_block

KEY = make_key("codec")


def _header(data: bytes) -> tuple[dict[str, object], int]:
    (length,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + length]), 8 + length


def _with_header(data: bytes, header: dict[str, object]) -> bytes:
    """Re-serialize ``data`` with a rewritten header (keeping the data section)."""
    _, start = _header(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[start:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    block = make_block(tokens=5, dtype=dtype, seed=1)
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    block.keys[0, 0, 0, :4] = special
    assert bit_equal(decode_block(KEY, encode_block(KEY, block)), block)


def test_round_trip_of_a_non_contiguous_block_is_bit_exact() -> None:
    base = make_block(tokens=6)
    block = KVBlock(base.keys.transpose(1, 2).transpose(1, 2)[:, :, ::2], base.values[:, :, ::2])
    decoded = decode_block(KEY, encode_block(KEY, block))
    assert torch.equal(decoded.keys, block.keys) and torch.equal(decoded.values, block.values)


def test_encoding_is_plain_safetensors_with_key_and_checksum_metadata() -> None:
    block = make_block()
    data = encode_block(KEY, block)
    loaded = safetensors.torch.load(data)
    assert torch.equal(loaded["keys"], block.keys) and torch.equal(loaded["values"], block.values)
    header, _ = _header(data)
    metadata = header["__metadata__"]
    assert isinstance(metadata, dict)
    assert metadata["block_key"] == KEY and len(metadata["checksum_blake3"]) == 64


def test_decoded_tensors_own_their_memory_and_are_writable() -> None:
    block = make_block()
    buffer = bytearray(encode_block(KEY, block))
    decoded = decode_block(KEY, buffer)
    buffer[:] = bytes(len(buffer))  # reusing the source buffer must not change the block
    assert bit_equal(decoded, block)
    decoded.keys.add_(1.0)  # in-place use (e.g. re-rotation) works on the decoded tensors
    assert torch.equal(decoded.keys, block.keys + 1.0)


def test_handing_over_a_bytearray_decodes_without_a_copy() -> None:
    block = make_block()
    decoded = decode_block(KEY, bytearray(encode_block(KEY, block)), copy=False)
    assert bit_equal(decoded, block)
    with pytest.raises(TypeError):
        decode_block(KEY, encode_block(KEY, block), copy=False)


def test_every_flipped_data_byte_is_detected() -> None:
    data = encode_block(KEY, make_block(tokens=1))
    _, start = _header(data)
    for position in range(start, len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x01
        with pytest.raises(CorruptBlockError):
            decode_block(KEY, damaged)


@pytest.mark.parametrize("mask", [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF])
def test_every_flipped_header_byte_is_detected(mask: int) -> None:
    data = encode_block(KEY, make_block(tokens=1))
    _, start = _header(data)
    for position in range(start):
        damaged = bytearray(data)
        damaged[position] ^= mask
        with pytest.raises(CorruptBlockError):
            verify_block(KEY, damaged)


def test_truncation_at_any_length_is_detected() -> None:
    data = encode_block(KEY, make_block(tokens=1))
    for length in range(len(data)):
        with pytest.raises(CorruptBlockError):
            verify_block(KEY, data[:length])


def test_trailing_bytes_are_detected() -> None:
    with pytest.raises(CorruptBlockError):
        decode_block(KEY, encode_block(KEY, make_block()) + b"\0" * 8)


def test_a_block_stored_under_another_key_is_refused() -> None:
    data = encode_block(KEY, make_block())
    with pytest.raises(CorruptBlockError, match="holds block"):
        decode_block(make_key("other"), data)


def test_a_changed_shape_with_consistent_offsets_is_detected() -> None:
    data = encode_block(KEY, make_block(tokens=4))  # shape [2, 3, 4, 8]
    header, _ = _header(data)
    for name in ("keys", "values"):
        entry = header[name]
        assert isinstance(entry, dict)
        entry["shape"] = [2, 3, 8, 4]
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(KEY, _with_header(data, header))


def test_a_changed_dtype_of_the_same_width_is_detected() -> None:
    data = encode_block(KEY, make_block(dtype=torch.bfloat16))
    header, _ = _header(data)
    for name in ("keys", "values"):
        entry = header[name]
        assert isinstance(entry, dict)
        entry["dtype"] = "F16"
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(KEY, _with_header(data, header))


def test_swapped_keys_and_values_are_detected() -> None:
    data = encode_block(KEY, make_block())
    header, _ = _header(data)
    header["keys"], header["values"] = header["values"], header["keys"]
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(KEY, _with_header(data, header))


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\0" * 8, b"\xff" * 64, struct.pack("<Q", 2) + b"{}", struct.pack("<Q", 4) + b"[1] "],
)
def test_garbage_is_refused(garbage: bytes) -> None:
    with pytest.raises(CorruptBlockError):
        decode_block(KEY, garbage)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_refused_not_crashed_on(garbage: bytes) -> None:
    with pytest.raises(CorruptBlockError):
        decode_block(KEY, garbage)


@pytest.mark.parametrize("bad_key", ["", "abc", "../" + "a" * 61, "A" * 64, "g" * 64, "a" * 65])
def test_invalid_keys_are_rejected(bad_key: str) -> None:
    with pytest.raises(ValueError):
        encode_block(bad_key, make_block())
    with pytest.raises(ValueError):
        decode_block(bad_key, encode_block(KEY, make_block()))


def test_unsupported_dtypes_are_rejected_at_encode() -> None:
    block = make_block()
    with pytest.raises(ValueError, match="dtype"):
        encode_block(KEY, KVBlock(block.keys.to(torch.int32), block.values.to(torch.int32)))


def test_an_empty_block_round_trips() -> None:
    block = make_block(tokens=0)
    for decoded in (
        decode_block(KEY, encode_block(KEY, block)),
        decode_block(KEY, bytearray(encode_block(KEY, block)), copy=False),
    ):
        assert decoded.keys.shape == decoded.values.shape == (2, 3, 0, 8)
