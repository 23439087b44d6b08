"""Paged KV cache bookkeeping: which block holds which request's tokens.

Full blocks are named by a hash chain over their tokens (the hash of a block covers the
whole prefix up to it), so a request whose prompt starts like an earlier one reuses its
blocks. A block whose last owner leaves keeps its name and waits in the free queue; it is
reused for the same prefix until an allocation needs the space (LRU eviction).

Invariants (`check_integrity`): a block is either free (no owner, in the free queue) or
used (owned, not in the queue); its reference count equals the number of block tables
holding it; only named (full, immutable) blocks are shared; free + used == total.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...]]
# The parent of a prompt's first block. An int, not None: Python hashes tuples of ints the
# same way in every process, but hash(None) is an address before Python 3.12, so a chain
# rooted at None would differ between a replica and the router that reads its names.
ROOT = 0


def prefix_root(namespace: str | None) -> int:
    """The parent of a prompt's first block: ROOT for the base model, another for each
    prefix namespace (SamplingParams.prefix_namespace: a LoRA adapter, whose KV differs
    from the base model's for the same tokens, and a cache salt), so that no block is
    shared across them. From a digest of the name, the same in every process (Python's str
    hash is salted per process)."""
    if namespace is None:
        return ROOT
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        namespace: str | None = None) -> list[int]:
    """The names (hashes of their keys) that the blocks of a prompt's cacheable prefix
    would have: the chain `get_computed_blocks` walks, computable in any process that has
    the token ids (the request router does, in the ingress)."""
    hashes: list[int] = []
    parent = prefix_root(namespace)
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # (hash of parent key, tokens) once full and named

    @property
    def hash(self) -> int | None:
        return None if self.key is None else hash(self.key)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Eviction order: front first. Nameless blocks go to the front (worthless),
        # named ones to the back (most recently used last).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[BlockKey, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.num_named_blocks: dict[str, int] = {}
        # Names of the cached blocks (hashes of their keys), kept as they change, for the
        # request router's reports; `names_version` moves whenever the set does.
        self.cached_names: set[int] = set()
        self.names_version = 0
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from cache

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def get_computed_blocks(self, token_ids: Sequence[int], namespace: str | None = None
                            ) -> tuple[list[int], int]:
        """Longest cached prefix of `token_ids` (in the prefix namespace `namespace`: a LoRA
        adapter's, a cache salt's; SamplingParams.prefix_namespace), in whole
        blocks. At least one token is always left to compute, since its logits are needed
        to sample."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        parent = prefix_root(namespace)
        for i in range(max_blocks):
            key = (parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            block_id = self.cached_block_ids.get(key)
            if block_id is None:
                break
            hits.append(block_id)
            parent = hash(key)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_queries += len(token_ids)
        self.prefix_hits += num_hit_tokens
        return hits, num_hit_tokens

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               computed_block_ids: Sequence[int] = ()) -> int:
        """Free-queue blocks an `allocate` for `num_tokens` total slots would take."""
        have = len(self.block_tables.get(request_id, ())) + len(computed_block_ids)
        new = max(0, -(-num_tokens // self.block_size) - have)
        # Touching a cached block that nobody owns also takes it off the free queue.
        revived = sum(1 for b in computed_block_ids if self.blocks[b].ref_count == 0)
        return new + revived

    def can_allocate(self, request_id: str, num_tokens: int,
                     computed_block_ids: Sequence[int] = ()) -> bool:
        needed = self.num_blocks_to_allocate(request_id, num_tokens, computed_block_ids)
        return needed <= len(self.free_block_ids)

    # -- changes -------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int,
                 computed_block_ids: Sequence[int] = ()) -> list[int]:
        """Grow the request's table to hold `num_tokens` slots; return the block ids added
        (the computed prefix first). Call `can_allocate` first."""
        if not self.can_allocate(request_id, num_tokens, computed_block_ids):
            raise RuntimeError(f"not enough free KV blocks for {request_id}")
        table = self.block_tables.setdefault(request_id, [])
        if computed_block_ids and table:
            raise RuntimeError("a computed prefix can only start an empty block table")
        added: list[int] = []
        for block_id in computed_block_ids:
            self._take(block_id)
            added.append(block_id)
        if computed_block_ids:
            self.num_named_blocks[request_id] = len(computed_block_ids)
        table.extend(added)
        while len(table) * self.block_size < num_tokens:
            block_id = next(iter(self.free_block_ids))
            self._forget(self.blocks[block_id])  # evict: its old tokens are overwritten
            self._take(block_id)
            table.append(block_id)
            added.append(block_id)
        return added

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int,
                          namespace: str | None = None) -> None:
        """Name the blocks that the first `num_tokens` tokens fill, so others can reuse
        them. Called when those tokens are scheduled: they are known, and any request that
        could hit them runs in a later step, after they are written."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request_id]
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        start = self.num_named_blocks.get(request_id, 0)
        parent = self.blocks[table[start - 1]].hash if start else prefix_root(namespace)
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            key = (parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            if key not in self.cached_block_ids:
                block.key = key
                self.cached_block_ids[key] = block.block_id
                self.cached_names.add(hash(key))
                self.names_version += 1
            # else: another request computed the same block first; this copy stays
            # nameless (owned by one request) and its successors chain on the key.
            parent = hash(key)
        self.num_named_blocks[request_id] = max(start, num_full)

    def fork(self, parent_id: str, child_id: str) -> int:
        """Share the parent's named prefix with a new request (for n > 1 and best_of);
        returns how many tokens the child need not compute. The partial tail is not
        shared: the child recomputes it (under a block), which avoids copy-on-write."""
        if child_id in self.block_tables:
            raise RuntimeError(f"{child_id} already has blocks")
        shared = []
        for block_id in self.block_tables.get(parent_id, ()):
            if self.blocks[block_id].key is None:
                break
            shared.append(block_id)
        for block_id in shared:
            self._take(block_id)
        self.block_tables[child_id] = shared
        self.num_named_blocks[child_id] = len(shared)
        return len(shared) * self.block_size

    def free(self, request_id: str) -> None:
        """Release the request's blocks (finish, abort or preemption). Tail blocks are
        released first so that they are evicted before the prefix they extend."""
        table = self.block_tables.pop(request_id, [])
        self.num_named_blocks.pop(request_id, None)
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.key is None:
                    self.free_block_ids.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_block_ids:
            self._forget(self.blocks[block_id])

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _forget(self, block: Block) -> None:
        if block.key is not None and self.cached_block_ids.get(block.key) == block.block_id:
            del self.cached_block_ids[block.key]
            self.cached_names.discard(hash(block.key))
            self.names_version += 1
        block.key = None

    # -- invariants ------------------------------------------------------------------
    def check_integrity(self) -> None:
        owners = [0] * self.num_blocks
        for request_id, table in self.block_tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"{request_id} holds a block twice: {table}")
            for block_id in table:
                owners[block_id] += 1
        for block in self.blocks:
            in_free = block.block_id in self.free_block_ids
            if block.ref_count != owners[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref {block.ref_count} "
                                     f"!= {owners[block.block_id]} owners")
            if in_free == (block.ref_count > 0):
                raise AssertionError(f"block {block.block_id} is both free and used, or neither")
            if block.ref_count > 1 and block.key is None:
                raise AssertionError(f"block {block.block_id} is shared but mutable")
        for key, block_id in self.cached_block_ids.items():
            if self.blocks[block_id].key != key:
                raise AssertionError(f"cache entry for block {block_id} is stale")
        if self.cached_names != {hash(key) for key in self.cached_block_ids}:
            raise AssertionError("cached block names differ from the cached blocks")
        if self.num_free_blocks + sum(o > 0 for o in owners) != self.num_blocks:
            raise AssertionError("free + used != total")
