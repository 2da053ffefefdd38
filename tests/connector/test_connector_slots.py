"""Where the connector writes each loaded token in vLLM's paged cache (needs vLLM to import)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
# Not plain "vllm": with tests/ on sys.path this folder itself would import as a namespace package.
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1",
                    reason="vLLM is not installed in this environment (the vllm extra)")

from kvshard_sidecar.vllm.connector import LoadSpec  # noqa: E402  (after the skip)


def test_slots_follow_the_request_blocks_across_a_partial_last_block() -> None:
    spec = LoadSpec("r", token_ids=list(range(11)), block_ids=[7, 2, 5], start=0, count=10)
    assert spec.slot_mapping(4).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert spec.touched_blocks(4) == {7, 2, 5}


def test_a_load_after_a_local_prefix_hit_starts_at_its_first_uncached_token() -> None:
    spec = LoadSpec("r", token_ids=list(range(11)), block_ids=[7, 2, 5], start=4, count=6)
    assert spec.slot_mapping(4).tolist() == [8, 9, 10, 11, 20, 21]
    assert spec.touched_blocks(4) == {2, 5}
