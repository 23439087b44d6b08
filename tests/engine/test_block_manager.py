"""Block manager: unit behaviour and a hypothesis state machine over random sequences of
allocate / append / fork / free / preempt that checks the invariants after every rule."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import BlockManager, prefix_block_hashes
from engine.sampling_params import SamplingParams

BS = 4


def admit(bm: BlockManager, rid: str, tokens: list[int], namespace: str | None = None) -> int:
    computed, num_cached = bm.get_computed_blocks(tokens, namespace)
    assert bm.can_allocate(rid, len(tokens), computed)
    bm.allocate(rid, len(tokens), computed)
    bm.cache_full_blocks(rid, tokens, len(tokens), namespace)
    return num_cached


def test_prefix_hit_reuses_blocks_and_counts():
    bm = BlockManager(16, BS)
    a = list(range(10))
    assert admit(bm, "a", a) == 0
    # Same first 8 tokens: two full blocks shared; one token always left to compute.
    assert admit(bm, "b", a[:8] + [99, 98]) == 8
    assert bm.get_block_ids("a")[:2] == bm.get_block_ids("b")[:2]
    assert bm.blocks[bm.get_block_ids("a")[0]].ref_count == 2
    bm.check_integrity()


def test_prefix_namespaces_share_blocks_only_within_themselves():
    """A LoRA adapter's blocks and a cache salt's (vLLM's cache_salt), named by
    SamplingParams.prefix_namespace, are found only by requests of the same adapter and
    salt; the router's chain names them as the replica does."""
    bm = BlockManager(64, BS)
    tokens = list(range(10))

    def space(**kw) -> str | None:
        return SamplingParams(**kw).prefix_namespace

    assert admit(bm, "a", tokens, space(cache_salt="t1")) == 0
    assert admit(bm, "b", tokens, space()) == 0  # the base model, no salt
    assert admit(bm, "c", tokens, space(cache_salt="t2")) == 0
    assert admit(bm, "d", tokens, space(cache_salt="t1")) == 8
    assert admit(bm, "e", tokens, space(adapter="t1")) == 0  # an adapter named as the salt
    assert admit(bm, "f", tokens, space(adapter="x", cache_salt="t1")) == 0
    assert admit(bm, "g", tokens, space(adapter="x", cache_salt="t1")) == 8
    assert admit(bm, "h", tokens, space()) == 8
    names = prefix_block_hashes(tokens, BS, space(cache_salt="t1"))
    assert names == [bm.blocks[b].hash for b in bm.get_block_ids("a")[:2]]
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_full_prompt_hit_leaves_last_token_to_compute():
    bm = BlockManager(16, BS)
    admit(bm, "a", list(range(8)))
    computed, num_cached = bm.get_computed_blocks(list(range(8)))
    assert num_cached == 4 and len(computed) == 1


def test_freed_named_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, BS)
    admit(bm, "a", list(range(8)))  # 2 named blocks
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert admit(bm, "b", list(range(8)) + [7]) == 8  # revived from the free queue
    bm.free("b")
    # A 16-token request needs every block: the cached ones are evicted.
    assert admit(bm, "c", list(range(100, 116))) == 0
    assert bm.get_computed_blocks(list(range(9)))[1] == 0
    bm.check_integrity()


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(3, BS)
    admit(bm, "a", list(range(8)))
    bm.free("a")
    computed, _ = bm.get_computed_blocks(list(range(9)))
    assert bm.num_blocks_to_allocate("b", 9, computed) == 3
    assert bm.can_allocate("b", 9, computed)
    assert not bm.can_allocate("b", 13, computed)


def test_fork_shares_named_prefix_only():
    bm = BlockManager(8, BS)
    admit(bm, "a", list(range(10)))  # blocks: full, full, partial
    assert bm.fork("a", "a2") == 8
    assert bm.get_block_ids("a2") == bm.get_block_ids("a")[:2]
    bm.check_integrity()
    bm.free("a")
    bm.free("a2")
    assert bm.num_used_blocks == 0
    bm.check_integrity()


def test_allocate_without_room_raises():
    bm = BlockManager(2, BS)
    with pytest.raises(RuntimeError):
        bm.allocate("a", 9)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.tokens: dict[str, list[int]] = {}  # running requests: their known tokens
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(length=st.integers(1, 20), alphabet=st.integers(1, 3), data=st.data())
    def allocate(self, length, alphabet, data):
        # A tiny alphabet makes prefix hits frequent.
        tokens = data.draw(st.lists(st.integers(0, alphabet), min_size=length, max_size=length))
        rid = self._new_id()
        computed, num_cached = self.bm.get_computed_blocks(tokens)
        assert num_cached < len(tokens)
        if self.bm.can_allocate(rid, len(tokens), computed):
            free_before = self.bm.num_free_blocks
            need = self.bm.num_blocks_to_allocate(rid, len(tokens), computed)
            self.bm.allocate(rid, len(tokens), computed)
            assert self.bm.num_free_blocks == free_before - need
            self.bm.cache_full_blocks(rid, tokens, len(tokens))
            self.tokens[rid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(1, 6))
    def append(self, data, count):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid] + [data.draw(st.integers(0, 3)) for _ in range(count)]
        if self.bm.can_allocate(rid, len(tokens)):
            self.bm.allocate(rid, len(tokens))
            self.bm.cache_full_blocks(rid, tokens, len(tokens))
            self.tokens[rid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        shared = self.bm.fork(parent, child)
        assert shared % BS == 0 and shared <= len(self.tokens[parent])
        # The child holds the shared prefix; it recomputes the rest under new blocks.
        self.tokens[child] = self.tokens[parent][:shared]
        if not shared:
            self.bm.free(child)
            del self.tokens[child]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(rid)
        tokens = self.tokens.pop(rid)
        if preempt:  # recompute: readmitted later, mostly from cache
            new_id = self._new_id()
            computed, _ = self.bm.get_computed_blocks(tokens)
            if self.bm.can_allocate(new_id, len(tokens), computed):
                self.bm.allocate(new_id, len(tokens), computed)
                self.bm.cache_full_blocks(new_id, tokens, len(tokens))
                self.tokens[new_id] = tokens

    @invariant()
    def integrity(self):
        self.bm.check_integrity()
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks
        for rid, tokens in self.tokens.items():
            assert len(self.bm.get_block_ids(rid)) * BS >= len(tokens)

    def teardown(self):
        for rid in list(self.tokens):
            self.bm.free(rid)
        self.bm.check_integrity()
        assert self.bm.num_used_blocks == 0


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                 deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
