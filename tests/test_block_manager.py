"""Block manager: allocation, reference counts, prefix caching, LRU eviction."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.core.block_manager import BlockManager
from tierserve.core.request import Request


def req(rid, tokens):
    return Request(request_id=rid, prompt_token_ids=list(tokens), max_tokens=4)


def admit(bm, r):
    """Allocate like the scheduler does on first scheduling; returns the cache hit."""
    blocks, hit = bm.get_computed_blocks(r)
    assert bm.allocate_slots(r, r.num_tokens - hit, blocks)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return hit


def test_allocation_covers_tokens_and_free_returns_everything():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = req("a", range(10))
    assert bm.allocate_slots(r, 10)
    assert len(r.block_table) == 3 and bm.num_free_blocks == 7
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 10
    bm.check_invariants()


def test_allocation_fails_without_side_effects_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = req("a", range(12))
    assert not bm.allocate_slots(r, 12)
    assert r.block_table == [] and bm.num_free_blocks == 2


def test_shared_prefix_is_reused_and_reference_counted():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(1000, 1012))                      # three full blocks
    a, b = req("a", system + [1, 2, 3]), req("b", system + [7, 8])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 12
    assert a.block_table[:3] == b.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table[:3])
    bm.check_invariants()


def test_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, req("a", range(8)))
    blocks, hit = bm.get_computed_blocks(req("b", range(8)))
    assert hit == 4 and len(blocks) == 1                  # 8 tokens: one block kept to compute


def test_different_prefix_with_same_last_block_does_not_hit():
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, req("a", [1, 2, 3, 4, 5]))
    _, hit = bm.get_computed_blocks(req("b", [9, 9, 3, 4, 5]))
    assert hit == 0                                       # block 2 chains block 1's hash


def test_freed_cached_blocks_survive_until_evicted_lru_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = req("a", [1, 2, 3]), req("b", [5, 6, 7])
    admit(bm, a)
    bm.free(a)                                            # a's [1,2] block is cached, free
    admit(bm, b)
    bm.free(b)                                            # b's [5,6] block cached later
    assert bm.num_free_blocks == 4
    filler = req("c", [9, 9, 9, 9, 9])                    # needs 3 blocks: evicts a's first
    assert bm.allocate_slots(filler, 5)
    assert bm.get_computed_blocks(req("x", [1, 2, 0]))[1] == 0
    assert bm.get_computed_blocks(req("y", [5, 6, 0]))[1] == 2
    bm.check_invariants()


def test_plain_free_blocks_are_used_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    admit(bm, a)
    bm.free(a)
    other = req("o", [8, 8, 8, 8])
    assert bm.allocate_slots(other, 4)                    # two plain blocks suffice
    assert bm.get_computed_blocks(req("x", [1, 2, 0]))[1] == 2


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(bm, req("a", [1, 2, 3, 4, 5]))
    assert bm.get_computed_blocks(req("b", [1, 2, 3, 4, 5]))[1] == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "free", "grow"]),
                          st.integers(0, 5), st.integers(1, 9)), max_size=60))
def test_invariants_hold_under_any_sequence_of_operations(ops):
    bm = BlockManager(num_blocks=12, block_size=3)
    live: dict[int, Request] = {}
    prefixes = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7]]
    for op, slot, n in ops:
        if op == "add" and slot not in live:
            r = req(f"r{slot}", prefixes[slot % 3] + list(range(n)))
            blocks, hit = bm.get_computed_blocks(r)
            if bm.allocate_slots(r, r.num_tokens - hit, blocks):
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
                live[slot] = r
        elif op == "grow" and slot in live:
            r = live[slot]
            r.output_token_ids += [50 + n] * n
            if bm.allocate_slots(r, r.num_tokens - r.num_computed_tokens):
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
            else:
                del r.output_token_ids[-n:]
        elif op == "free" and slot in live:
            bm.free(live.pop(slot))
        bm.check_invariants()
        assert sum(len(r.block_table) for r in live.values()) == \
            sum(b.ref_count for b in bm.blocks)
        for r in live.values():
            assert len(r.block_table) == bm.blocks_needed(r.num_computed_tokens)
    for r in live.values():
        bm.free(r)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
