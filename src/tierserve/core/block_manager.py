"""Paged KV-cache blocks: allocation, reference counts, prefix caching, LRU eviction.

NOTE: how blocks move
    A block is *in use* (ref_count > 0, held by one or more requests' block tables) or
    *free* (ref_count == 0). Free blocks wait in one of two queues:
      - `_free_plain`: blocks that hold no reusable prefix; handed out first.
      - `_free_cached[tier]`: full blocks whose tokens are known by a chained hash; they
        keep their KV so a later request with the same prefix reuses it. Handed out
        (evicted) only when no plain block is left: lowest tier first (a block's tier is
        the best tier of the requests that used it), least-recently-freed first within a
        tier. With `evict_by_tier` off every cached block sits in one LRU queue.
    All queues are OrderedDicts used as linked lists: append, pop-front and remove-by-id
    are O(1), so allocating, freeing and reviving a cached block never scan the pool.
    A request frees its blocks tail first, so its last blocks (least likely shared) are
    evicted before its first ones (a shared system prompt).

    A block's hash key is (parent_hash, tokens of the block): the hash of block i chains
    the hash of block i-1, so equal keys mean equal whole prefixes. The map compares the
    token tuple exactly, so a hash collision cannot alias two different blocks. The first
    block's parent is the request's cache salt (its owner's: the tenant's cache group and
    the request's `cache_salt`), compared exactly too: requests of different salts never
    share a block, so a tenant cannot learn from `cached_tokens` or from its time to first
    token that another tenant sent a prompt (vLLM's CVE-2025-46570).

Invariants (checked by `check_invariants`, exercised by property tests):
    1. A block is in exactly one free queue iff its ref_count is 0.
    2. Blocks in `_free_plain` have no key; blocks in a `_free_cached` queue have one, and
       sit in the queue of their tier.
    3. `_cached[key] is block` iff `block.key == key` (a keyed block is findable).
    4. num_free_blocks == len(_free_plain) + the lengths of the `_free_cached` queues.
"""

from collections import OrderedDict
from dataclasses import dataclass

from tierserve.core.request import Request
from tierserve.errors import ConfigError
from tierserve.tiers import Tier

BlockKey = tuple[object, tuple[int, ...]]
"""(parent: the previous block's hash, or the salt root for the first block; tokens)."""


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None
    tier: int = Tier.BATCH
    """Best tier among the requests that have held the block since it was last handed out."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 evict_by_tier: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"need num_blocks >= 1 and block_size >= 1, got "
                              f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.evict_by_tier = evict_by_tier
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in Tier]
        """Indexed by tier; evicted from the last (lowest tier) queue first."""
        self._num_free_cached = 0
        self._cached: dict[BlockKey, Block] = {}
        self._num_registered: dict[str, int] = {}
        """Per request: how many of its leading blocks have been offered to the cache."""

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + self._num_free_cached

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
                       computed_blocks: list[int] = (), reserve: int = 0) -> bool:
        """Make `request.block_table` cover its computed tokens plus `num_new_tokens`.

        `computed_blocks` are prefix-cache hits to prepend (first scheduling only). `reserve`
        free blocks must stay free afterwards (blocks held back for a better tier). Returns
        False, changing nothing, when the free pool cannot supply the blocks.
        """
        num_covered = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = -(-(num_covered + num_new_tokens) // self.block_size)
        num_new_blocks = num_required - len(request.block_table) - len(computed_blocks)
        if num_new_blocks <= 0 and not computed_blocks:
            return True  # the common decode step: the last block has room
        num_new_blocks = max(num_new_blocks, 0)
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        num_taken = num_new_blocks + num_revived
        if num_taken and num_taken > self.num_free_blocks - reserve:
            return False
        for block_id in computed_blocks:
            self._take(self.blocks[block_id], request.tier)
            request.block_table.append(block_id)
        if computed_blocks:
            self._num_registered[request.request_id] = len(request.block_table)
        for _ in range(num_new_blocks):
            request.block_table.append(self._pop_free(request.tier).block_id)
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
                self._queue_of(block)[block_id] = None
                self._num_free_cached += block.key is not None
        request.block_table = []
        self._num_registered.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        for queue in self._free_cached:
            for block_id in list(queue):
                self._uncache(self.blocks[block_id])
                self._free_plain[block_id] = None
            queue.clear()
        self._num_free_cached = 0

    # --------------------------------------------------------------- helpers
    def _queue_of(self, block: Block) -> OrderedDict:
        if block.key is None:
            return self._free_plain
        return self._free_cached[block.tier if self.evict_by_tier else 0]

    def _take(self, block: Block, tier: int) -> None:
        if block.ref_count == 0:
            del self._queue_of(block)[block.block_id]
            self._num_free_cached -= block.key is not None
        block.ref_count += 1
        block.tier = min(block.tier, tier)

    def _pop_free(self, tier: int) -> Block:
        if self._free_plain:
            block_id, _ = self._free_plain.popitem(last=False)
        else:
            queue = next(q for q in reversed(self._free_cached) if q)
            block_id, _ = queue.popitem(last=False)
            self._num_free_cached -= 1
        block = self.blocks[block_id]
        self._uncache(block)
        block.ref_count = 1
        block.tier = tier
        return block

    def _uncache(self, block: Block) -> None:
        if block.key is not None:
            del self._cached[block.key]
            block.key = None

    @staticmethod
    def _root(request: Request) -> object:
        salt = request.owner.cache_salt
        return 0 if salt is None else ("salt", salt)

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, bs = request.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else self._root(request)
            hashes.append(hash((parent, tuple(request.tokens_slice(i * bs, (i + 1) * bs)))))

    def _key(self, request: Request, i: int) -> BlockKey:
        parent = request.block_hashes[i - 1] if i else self._root(request)
        bs = self.block_size
        return parent, tuple(request.tokens_slice(i * bs, (i + 1) * bs))

    def check_invariants(self) -> None:
        assert self.num_free_blocks == sum(1 for b in self.blocks if b.ref_count == 0)
        assert self._num_free_cached == sum(len(q) for q in self._free_cached)
        for block in self.blocks:
            assert block.ref_count >= 0
            in_plain = block.block_id in self._free_plain
            in_cached = [i for i, q in enumerate(self._free_cached) if block.block_id in q]
            assert (in_plain or bool(in_cached)) == (block.ref_count == 0), block
            assert not (in_plain and in_cached) and len(in_cached) <= 1, block
            assert not in_plain or block.key is None, block
            assert not in_cached or block.key is not None, block
            if in_cached:
                assert in_cached[0] == (block.tier if self.evict_by_tier else 0), block
            if block.key is not None:
                assert self._cached[block.key] is block
        for key, block in self._cached.items():
            assert block.key == key
