import pytest

from worker.kv.block_manager import NO_HIT, BlockManager, PrefixHit
from worker.kv.prefix_hasher import PrefixHasher


def test_allocation_is_exact_and_fifo():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.can_allocate("a", 5)
    assert bm.allocate("a", 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert bm.allocate("a", 8) == []  # still fits in 2 blocks
    assert bm.allocate("a", 9) == [2]
    assert bm.allocate("b", 1) == [3]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 2 and bm.num_used_blocks == 4
    assert bm.num_missing_blocks("b", 12) == 2
    assert bm.can_allocate("b", 12) and not bm.can_allocate("b", 13)
    with pytest.raises(RuntimeError, match="only 2 free"):
        bm.allocate("b", 13)
    assert bm.block_table("b") == [3]  # a refused allocation changes nothing


def test_free_returns_blocks_in_order_and_reuses_them():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)  # [0, 1]
    bm.allocate("b", 3)  # [2, 3]
    assert bm.num_free_blocks == 0
    assert bm.free("a") == 2
    assert bm.free("a") == 0  # idempotent
    assert bm.allocate("c", 3) == [0, 1]
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 4
    assert bm.allocate("d", 8) == [2, 3, 0, 1]


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


# ---- prefix caching --------------------------------------------------------------------------

BLOCK = 4


def caching_manager(num_blocks: int = 20, namespace: str = "ckpt-a/torch.float32",
                    long_prompt_tokens: int | None = None) -> BlockManager:
    return BlockManager(num_blocks, BLOCK,
                        prefix_hasher=PrefixHasher(namespace, BLOCK, long_prompt_tokens=long_prompt_tokens))


def admit(bm: BlockManager, seq_id: str, tokens: list[int], num_computed: int | None = None) -> PrefixHit:
    """What the scheduler does for a new sequence: look up, allocate after the hit, and -- once its
    KV is computed (all of it unless said otherwise) -- name its full blocks."""
    hit = bm.find_cached_prefix(seq_id, tokens, len(tokens))
    assert bm.can_allocate(seq_id, len(tokens), hit)
    bm.allocate(seq_id, len(tokens), hit)
    bm.cache_full_blocks(seq_id, tokens, len(tokens), len(tokens) if num_computed is None else num_computed)
    return hit


SHARED = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]  # 3 full blocks


def test_a_shared_three_block_prefix_takes_three_fewer_fresh_blocks():
    bm = caching_manager()
    first = admit(bm, "a", SHARED + [1, 2])  # 14 tokens: 4 blocks, the first 3 full
    assert first == PrefixHit(block_ids=(), num_tokens=0, num_queried_tokens=14)
    assert bm.block_table("a") == [0, 1, 2, 3] and bm.num_cached_blocks == 3
    hit = bm.find_cached_prefix("b", SHARED + [7, 8, 9], 15)
    assert hit == PrefixHit(block_ids=(0, 1, 2), num_tokens=12, num_queried_tokens=15)
    assert bm.num_missing_blocks("b", 15, hit) == 1
    assert bm.allocate("b", 15, hit) == [4]  # one fresh block where 4 would be needed without the cache
    assert bm.block_table("b") == [0, 1, 2, 4] and bm.num_used_blocks == 5
    assert [bm.ref_count(b) for b in range(6)] == [2, 2, 2, 1, 1, 0]
    assert (bm.num_prefix_queried_tokens, bm.num_prefix_hit_tokens) == (14 + 15, 12)


def test_a_whole_cached_prompt_still_computes_its_last_block_in_a_private_one():
    bm = caching_manager()
    admit(bm, "a", SHARED + [1])
    hit = bm.find_cached_prefix("b", SHARED, 12)  # all 3 blocks cached, but the last token's block is not taken
    assert hit == PrefixHit(block_ids=(0, 1), num_tokens=8, num_queried_tokens=12)
    assert bm.allocate("b", 12, hit) == [4]
    assert bm.block_table("b") == [0, 1, 4]
    # b's recomputed last block holds a prefix block 2 already holds: it stays private.
    assert bm.cache_full_blocks("b", SHARED, 12, 12) == 0 and bm.num_cached_blocks == 3
    bm.free("b")
    assert bm.ref_count(4) == 0 and 4 not in bm.evictable_block_ids()


def test_only_computed_full_blocks_are_cached_and_decode_fills_more():
    bm = caching_manager()
    tokens = SHARED[:6]
    admit(bm, "a", tokens, num_computed=5)  # 5 of 6 computed: one full block
    assert bm.num_cached_blocks == 1
    tokens = tokens + [201, 202, 203]  # decoding: three tokens generated, 8 computed now
    bm.allocate("a", len(tokens))
    assert bm.cache_full_blocks("a", tokens, 6, 8) == 1 and bm.num_cached_blocks == 2
    assert bm.cache_full_blocks("a", tokens, 6, 8) == 0  # nothing new
    bm.free("a")
    # The next turn of the chat: its prompt is the history (prompt + output) and more.
    hit = bm.find_cached_prefix("turn2", tokens + [5, 6, 7], 12)
    assert hit.block_ids == (0, 1) and hit.num_tokens == 8


def test_an_equal_block_after_a_different_parent_is_not_a_hit():
    bm = caching_manager()
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    admit(bm, "a", x + y + [0])
    assert bm.find_cached_prefix("b", z + y + [0], 9).block_ids == ()  # y after z is another block
    assert bm.find_cached_prefix("c", x + z + [0], 9).block_ids == (0,)  # the chain breaks at z
    assert bm.find_cached_prefix("d", x + y + [3, 3], 10).block_ids == (0, 1)


def test_two_models_never_share_a_block_name():
    tokens = list(range(12))
    hashes = {}
    for namespace in ("ckpt-a/torch.float32", "ckpt-b/torch.float32", "ckpt-a/torch.bfloat16"):
        chain: list[bytes] = []
        PrefixHasher(namespace, BLOCK).extend(chain, tokens, 12, 3)
        hashes[namespace] = chain
    assert len({h for chain in hashes.values() for h in chain}) == 9  # 3 models x 3 blocks, all distinct
    chain: list[bytes] = []
    PrefixHasher("ckpt-a/torch.float32", BLOCK).extend(chain, tokens, 12, 3)
    assert chain == hashes["ckpt-a/torch.float32"]  # and a model names its blocks the same way every time
    one, other = caching_manager(namespace="ckpt-a/torch.float32"), caching_manager(namespace="ckpt-b/torch.float32")
    admit(one, "a", tokens + [0])
    assert other.find_cached_prefix("b", tokens + [0], 13).block_ids == ()


def test_longrope_prompts_past_the_original_context_are_named_apart():
    bm = caching_manager(long_prompt_tokens=10)
    short = SHARED[:9]
    admit(bm, "short", short)  # 9 <= 10: the short frequency set everywhere
    assert bm.find_cached_prefix("long", SHARED, 12).block_ids == ()  # 12 > 10: every token rotated long
    assert bm.find_cached_prefix("short2", SHARED[:10], 10).block_ids == (0, 1)
    admit(bm, "long", SHARED + [1])
    assert bm.find_cached_prefix("long2", SHARED + [2], 13).block_ids == (3, 4, 5)


def test_freed_cached_blocks_are_evicted_least_recent_first_tail_first():
    bm = caching_manager(num_blocks=8)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]
    admit(bm, "a", a)  # [0, 1, 2]: 0 and 1 cached
    admit(bm, "b", b)  # [3, 4, 5]: 3 and 4 cached
    bm.free("a")
    bm.free("b")
    assert bm.evictable_block_ids() == [1, 0, 4, 3]  # a before b; each chain's tail before its head
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 4
    # Never-cached blocks go first (6, 7, then 2 and 5 freed uncached), then the LRU's oldest.
    assert bm.allocate("c", 7 * BLOCK) == [6, 7, 2, 5, 1, 0, 4]
    assert bm.evictable_block_ids() == [3] and bm.num_cached_blocks == 1
    bm.free("c")
    assert bm.find_cached_prefix("b2", b, 9).block_ids == (3,)  # b's head survived; its tail was evicted


def test_a_hit_takes_its_blocks_back_from_the_lru_and_counts_them_against_the_free_blocks():
    bm = caching_manager(num_blocks=4)
    admit(bm, "a", SHARED + [1])  # all 4 blocks, 3 cached
    bm.free("a")
    assert bm.num_free_blocks == 4
    hit = bm.find_cached_prefix("b", SHARED + [1], 13)
    assert hit.block_ids == (0, 1, 2)
    assert bm.can_allocate("b", 16, hit)  # 1 fresh block: the uncached one
    assert not bm.can_allocate("b", 17, hit)  # 2 fresh: the 3 free cached ones are the hit itself
    with pytest.raises(RuntimeError, match="only 1 free"):
        bm.allocate("b", 17, hit)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 4  # a refused allocation changes nothing
    assert bm.allocate("b", 13, hit) == [3]
    assert bm.evictable_block_ids() == [] and bm.num_free_blocks == 0


def test_references_drop_on_free_and_a_shared_block_stays_with_its_other_holder():
    bm = caching_manager()
    admit(bm, "a", SHARED + [1])
    admit(bm, "b", SHARED + [2])
    admit(bm, "c", SHARED[:8] + [3])
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [3, 3, 2]
    bm.free("a")
    assert [bm.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 0]
    assert bm.evictable_block_ids() == [] and bm.num_free_blocks == 20 - 5  # b: 0 1 2 4, c: 0 1 5
    bm.free("b")
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [1, 1, 0] and bm.evictable_block_ids() == [2]
    bm.free("c")
    assert bm.num_free_blocks == 20 and bm.evictable_block_ids() == [2, 1, 0]
    stale = bm.find_cached_prefix("d", SHARED + [1], 13)
    bm.allocate("e", 18 * BLOCK)  # the 17 never-cached blocks, then the LRU's oldest: block 2
    assert bm.evictable_block_ids() == [1, 0]
    with pytest.raises(RuntimeError, match="no longer cached: look it up again"):  # looked up before the eviction
        bm.allocate("d", 13, stale)
    assert bm.block_table("d") == [] and bm.find_cached_prefix("d", SHARED + [1], 13).block_ids == (0, 1)


def test_the_same_prefix_computed_twice_caches_the_first_copy_only():
    bm = caching_manager()
    hit_a = bm.find_cached_prefix("a", SHARED + [1], 13)
    hit_b = bm.find_cached_prefix("b", SHARED + [1], 13)  # both admitted before either is computed
    bm.allocate("a", 13, hit_a)
    bm.allocate("b", 13, hit_b)
    assert bm.cache_full_blocks("a", SHARED + [1], 13, 13) == 3
    assert bm.cache_full_blocks("b", SHARED + [1], 13, 13) == 0
    assert bm.find_cached_prefix("c", SHARED + [1], 13).block_ids == (0, 1, 2)
    bm.free("b")
    assert bm.evictable_block_ids() == [] and bm.num_free_blocks == 20 - 4


def test_without_a_hasher_nothing_is_cached():
    bm = BlockManager(10, BLOCK)
    assert not bm.enable_prefix_caching
    assert bm.find_cached_prefix("a", SHARED, 12) is NO_HIT
    bm.allocate("a", 12)
    assert bm.cache_full_blocks("a", SHARED, 12, 12) == 0 and bm.num_cached_blocks == 0
    bm.free("a")
    assert bm.evictable_block_ids() == [] and bm.allocate("b", 12) == [3, 4, 5]


def test_hasher_and_manager_refuse_bad_settings():
    with pytest.raises(ValueError, match="namespace"):
        PrefixHasher("", BLOCK)
    with pytest.raises(ValueError, match="long_prompt_tokens"):
        PrefixHasher("m", BLOCK, long_prompt_tokens=0)
    with pytest.raises(ValueError, match="hashes blocks of 8 tokens, not 4"):
        BlockManager(10, BLOCK, prefix_hasher=PrefixHasher("m", 8))
    with pytest.raises(ValueError, match="3 full blocks, not 4"):
        PrefixHasher("m", BLOCK).extend([], SHARED, 12, 4)


def test_cache_full_blocks_names_only_blocks_whose_tokens_are_known():
    """A computed count one ahead of the token list (a step's token not yet appended) must not
    fail or name a block with a missing token: it names the blocks the tokens fill."""
    manager = caching_manager()
    tokens = list(range(3 * BLOCK - 1))  # 2 full blocks and one short of a third
    manager.allocate("s", 3 * BLOCK)
    assert manager.cache_full_blocks("s", tokens, num_prompt_tokens=len(tokens), num_computed_tokens=3 * BLOCK) == 2


def test_forget_cached_frees_every_cached_block_only_when_none_is_held():
    from worker.kv.block_pool import BlockPool

    pool = BlockPool(4)
    [a, b] = pool.take(2)
    pool.register(a, b"h-a")
    with pytest.raises(RuntimeError, match="2 block"):
        pool.forget_cached()
    pool.release([a, b])
    assert pool.num_cached == 1 and pool.evictable_block_ids() == [a]
    assert pool.forget_cached() == 1
    assert (pool.num_cached, pool.evictable_block_ids(), pool.cached_block(b"h-a"), pool.num_free) == (0, [], None, 4)
