"""Paged KV-cache blocks: allocation, reference counts, prefix caching, LRU eviction.

NOTE: how blocks move
    A block is *in use* (ref_count > 0, held by one or more requests' block tables) or
    *free* (ref_count == 0). Free blocks wait in one of two queues:
      - `_free_plain`: blocks that hold no reusable prefix; handed out first.
      - `_free_cached`: full blocks whose tokens are known by a chained hash; they keep
        their KV so a later request with the same prefix reuses it. Handed out (evicted)
        least-recently-freed first, only when no plain block is left.
    Both queues are OrderedDicts used as linked lists: append, pop-front and remove-by-id
    are O(1), so allocating, freeing and reviving a cached block never scan the pool.
    A request frees its blocks tail first, so its last blocks (least likely shared) are
    evicted before its first ones (a shared system prompt).

    A block's hash key is (parent_hash, tokens of the block): the hash of block i chains
    the hash of block i-1, so equal keys mean equal whole prefixes. The map compares the
    token tuple exactly, so a hash collision cannot alias two different blocks.

Invariants (checked by `check_invariants`, exercised by property tests):
    1. A block is in exactly one free queue iff its ref_count is 0.
    2. Blocks in `_free_plain` have no key; blocks in `_free_cached` have one.
    3. `_cached[key] is block` iff `block.key == key` (a keyed block is findable).
    4. num_free_blocks == len(_free_plain) + len(_free_cached).
"""

from collections import OrderedDict
from dataclasses import dataclass

from tierserve.core.request import Request
from tierserve.errors import ConfigError

BlockKey = tuple[int, tuple[int, ...]]


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"need num_blocks >= 1 and block_size >= 1, got "
                              f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockKey, Block] = {}
        self._num_registered: dict[str, int] = {}
        """Per request: how many of its leading blocks have been offered to the cache."""

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of `request`: (block ids, tokens they cover).

        At least one token is always left to compute, so the step still yields logits.
        Does not take references; `allocate_slots` does.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            block = self._cached.get(self._key(request, i))
            if block is None:
                break
            hits.append(block.block_id)
        return hits, len(hits) * self.block_size

    # ------------------------------------------------------------- mutations
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] = ()) -> bool:
        """Make `request.block_table` cover its computed tokens plus `num_new_tokens`.

        `computed_blocks` are prefix-cache hits to prepend (first scheduling only). Returns
        False, changing nothing, when the free pool cannot supply the blocks.
        """
        num_covered = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_covered + num_new_tokens)
        num_new_blocks = num_required - len(request.block_table) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - num_revived:
            return False
        for block_id in computed_blocks:
            self._take(self.blocks[block_id])
            request.block_table.append(block_id)
        if computed_blocks:
            self._num_registered[request.request_id] = len(request.block_table)
        for _ in range(max(num_new_blocks, 0)):
            request.block_table.append(self._pop_free().block_id)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(request, num_full)
        for i in range(start, num_full):
            block = self.blocks[request.block_table[i]]
            key = self._key(request, i)
            if block.key is None and key not in self._cached:
                block.key = key
                self._cached[key] = block
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Drop the request's references, tail first; its full blocks stay cached."""
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                queue = self._free_plain if block.key is None else self._free_cached
                queue[block_id] = None
        request.block_table = []
        self._num_registered.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._free_cached):
            self._uncache(self.blocks[block_id])
            del self._free_cached[block_id]
            self._free_plain[block_id] = None

    # --------------------------------------------------------------- helpers
    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            queue = self._free_plain if block.key is None else self._free_cached
            del queue[block.block_id]
        block.ref_count += 1

    def _pop_free(self) -> Block:
        queue = self._free_plain if self._free_plain else self._free_cached
        block_id, _ = queue.popitem(last=False)
        block = self.blocks[block_id]
        self._uncache(block)
        block.ref_count = 1
        return block

    def _uncache(self, block: Block) -> None:
        if block.key is not None:
            del self._cached[block.key]
            block.key = None

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, bs = request.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else 0
            hashes.append(hash((parent, tuple(request.tokens_slice(i * bs, (i + 1) * bs)))))

    def _key(self, request: Request, i: int) -> BlockKey:
        parent = request.block_hashes[i - 1] if i else 0
        bs = self.block_size
        return parent, tuple(request.tokens_slice(i * bs, (i + 1) * bs))

    def check_invariants(self) -> None:
        assert self.num_free_blocks == sum(1 for b in self.blocks if b.ref_count == 0)
        for block in self.blocks:
            assert block.ref_count >= 0
            in_plain = block.block_id in self._free_plain
            in_cached = block.block_id in self._free_cached
            assert (in_plain or in_cached) == (block.ref_count == 0), block
            assert not (in_plain and in_cached), block
            assert not in_plain or block.key is None, block
            assert not in_cached or block.key is not None, block
            if block.key is not None:
                assert self._cached[block.key] is block
        for key, block in self._cached.items():
            assert block.key == key
