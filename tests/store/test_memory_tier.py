"""The memory tier: an LRU that never holds more bytes than its budget."""

from __future__ import annotations

import threading
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import make_block, make_key

from kvshard_sidecar.blockstore import KVBlock, MemoryTier

TOKEN_BYTES = 2 * 3 * 8 * 4 * 2  # one token of a make_block() block: keys + values, float32

operations = st.lists(
    st.tuples(st.sampled_from(["put", "get", "evict"]), st.integers(0, 7), st.integers(1, 6)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(budget_tokens=st.integers(0, 16), ops=operations)
def test_lru_never_exceeds_its_budget_and_matches_a_reference_lru(
    budget_tokens: int, ops: list[tuple[str, int, int]]
) -> None:
    budget = budget_tokens * TOKEN_BYTES
    tier = MemoryTier(budget)
    reference: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
    blocks: dict[str, KVBlock] = {}
    for op, name, tokens in ops:
        key = make_key(name)
        if op == "put":
            block = make_block(tokens=tokens, seed=name)
            stored = tier.put(key, block)
            assert stored == (block.nbytes <= budget)
            if stored:
                reference.pop(key, None)
                while sum(reference.values()) + block.nbytes > budget:
                    reference.popitem(last=False)
                reference[key] = block.nbytes
                blocks[key] = block
        elif op == "get":
            got = tier.get(key)
            assert (got is not None) == (key in reference)
            if got is not None:
                assert got is blocks[key]
                reference.move_to_end(key)
        else:
            assert tier.evict(key) == (reference.pop(key, None) is not None)
        stats = tier.stats()
        assert stats.bytes <= budget
        assert stats.bytes == sum(reference.values())
        assert list(tier.keys()) == list(reference)


def test_a_block_bigger_than_the_whole_budget_is_not_stored() -> None:
    block = make_block(tokens=4)
    tier = MemoryTier(block.nbytes - 1)
    assert not tier.put(make_key("big"), block)
    assert tier.stats().bytes == 0 and len(tier) == 0


def test_get_refreshes_recency_so_the_least_recently_used_block_goes_first() -> None:
    a, b, c = make_key("a"), make_key("b"), make_key("c")
    tier = MemoryTier(2 * make_block().nbytes)
    tier.put(a, make_block())
    tier.put(b, make_block())
    assert tier.get(a) is not None
    tier.put(c, make_block())
    assert tier.contains(a) and tier.contains(c) and not tier.contains(b)


def test_contains_neither_counts_nor_refreshes() -> None:
    a, b, c = make_key("a"), make_key("b"), make_key("c")
    tier = MemoryTier(2 * make_block().nbytes)
    tier.put(a, make_block())
    tier.put(b, make_block())
    assert tier.contains(a)
    tier.put(c, make_block())
    assert not tier.contains(a)
    stats = tier.stats()
    assert (stats.hits, stats.misses) == (0, 0)


def test_stats_count_hits_misses_evictions_bytes_and_entries() -> None:
    block = make_block()
    tier = MemoryTier(2 * block.nbytes)
    for name in ("a", "b", "c"):
        tier.put(make_key(name), block)
    tier.get(make_key("c"))
    tier.get(make_key("c"))
    tier.get(make_key("a"))
    tier.evict(make_key("b"))  # an explicit evict is not a budget eviction
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.corrupt) == (2, 1, 1, 0)
    assert (stats.bytes, stats.entries) == (block.nbytes, 1)


def test_concurrent_threads_keep_the_budget_and_the_byte_count_exact() -> None:
    budget = 5 * make_block(tokens=3).nbytes
    tier = MemoryTier(budget)
    blocks = [make_block(tokens=1 + i % 5, seed=i) for i in range(40)]
    errors: list[str] = []

    def worker(offset: int) -> None:
        for step in range(300):
            index = (offset * 7 + step) % len(blocks)
            tier.put(make_key(index), blocks[index])
            tier.get(make_key((index * 3) % len(blocks)))
            if tier.stats().bytes > budget:
                errors.append("over budget")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    held = [tier.get(key) for key in list(tier.keys())]
    assert tier.stats().bytes == sum(block.nbytes for block in held if block is not None) <= budget
