"""Paged KV-cache block accounting, in integers only (nano-vLLM's habit: testable without a device).

The KV cache is a pool of ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A
sequence owns a block table: the list of block ids holding its tokens in order. Allocation
comes as a check/commit pair — `can_allocate` says whether a sequence can grow to hold N
tokens, `allocate` does it — so the scheduler can decide to preempt before touching state.
Free blocks are handed out first-in first-out, which makes block ids predictable in tests.

With a `PrefixHasher` (automatic prefix caching, vLLM v1's design) full blocks are also shared:

- `cache_full_blocks` names each full block whose KV is computed by the hash of its prefix
  (`worker.kv.prefix_hasher`): prompt blocks once prefilled, generated blocks as decoding fills
  them (so a chat's next turn finds its whole history);
- `find_cached_prefix` finds a new sequence's longest run of named blocks from its start, and
  `can_allocate` / `allocate` given that `PrefixHit` start its table with those blocks (one more
  reference each) and take fresh blocks only for the rest. The hit stops short of the block
  holding the sequence's last token, which is always computed (its logits are sampled): a whole
  cached prompt recomputes its last block into a private one, so a sequence only ever writes
  into blocks it alone holds and a shared block is never written;
- `free` drops one reference per block; cached blocks nobody holds wait in an LRU (`BlockPool`)
  until a later hit takes them back or a fresh block evicts them. They count as free;
- `claim_uncomputed_blocks` notes which not-yet-computed blocks an admitted sequence will compute,
  so a lookup that misses on one of them says who is computing it (`PrefixHit.computing_by`): the
  scheduler lets such a sequence wait a step or two for the block instead of computing the same
  KV a second time (a burst of requests behind one new system prompt computes it once). Claims end
  when the block is named (`cache_full_blocks`) or the claimer frees its blocks;
- `ride_in_flight` lets such a sequence share the claimed blocks in the very step that computes them
  (vLLM names a block when it is allocated, to the same effect): its hit goes on with the blocks the
  claimer's chunk in that step completes (`PrefixHit.num_in_flight` of them), so the burst's tails
  run in the prompt's own forward pass, whose layers write every token's KV before any attends.
  Such a block is shared before it is named: held by the claimer, named when either names it.

``num_prefix_queried_tokens`` / ``num_prefix_hit_tokens`` count the tokens looked up at
admission and the tokens found (vLLM's prefix-cache queries and hits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.kv.block_pool import BlockPool
from worker.kv.prefix_hasher import PrefixHasher

__all__ = ["NO_HIT", "BlockManager", "PrefixHit"]


@dataclass(frozen=True)
class PrefixHit:
    """What `find_cached_prefix` found: the cached blocks a sequence's table starts with, the
    tokens they hold, and how many tokens were looked up (the sequence's length)."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    num_queried_tokens: int = 0
    # The sequence computing the block right after the hit (claimed, not yet cached), if any.
    computing_by: str | None = None
    # The last `num_in_flight` of block_ids are not cached yet: their claimer computes them in the
    # step this hit is admitted to (`BlockManager.ride_in_flight`).
    num_in_flight: int = 0

    @property
    def cached_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[:len(self.block_ids) - self.num_in_flight]

    @property
    def in_flight_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[len(self.block_ids) - self.num_in_flight:]


NO_HIT = PrefixHit()  # no lookup made (prefix caching off, or a sequence that keeps its own blocks)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_hasher: PrefixHasher | None = None) -> None:
        """`prefix_hasher`: turns on prefix caching (None: every block is private, as before)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if prefix_hasher is not None and prefix_hasher.block_size != block_size:
            raise ValueError(f"prefix_hasher hashes blocks of {prefix_hasher.block_size} tokens, not {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._pool = BlockPool(num_blocks)
        self._hasher = prefix_hasher
        self._block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[bytes]] = {}  # per sequence: its chain so far (computed once)
        self._num_registered: dict[str, int] = {}  # per sequence: leading table blocks already named
        self._computing: dict[bytes, str] = {}  # block hash -> the sequence that will compute it
        self._claims: dict[str, list[bytes]] = {}  # per sequence: the hashes it claimed
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def enable_prefix_caching(self) -> bool:
        return self._hasher is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are reclaimed on demand)."""
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose KV a later prefix can reuse (held by sequences or waiting in the LRU)."""
        return self._pool.num_cached

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def forget_cached(self) -> int:
        """Forgets the cached KV of every block (see `BlockPool.forget_cached`): the KV pool is
        about to be freed. Only with no sequence holding blocks. Returns the blocks forgotten."""
        if self._block_tables or self._claims:
            raise RuntimeError(f"{len(self._block_tables)} sequence(s) still hold KV blocks")
        self._computing.clear()
        return self._pool.forget_cached()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._block_tables.get(seq_id, [])

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold the block."""
        return self._pool.ref_count(block_id)

    def evictable_block_ids(self) -> list[int]:
        """Cached blocks no sequence holds, the next to be evicted first."""
        return self._pool.evictable_block_ids()

    def num_missing_blocks(self, seq_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """Fresh blocks ``seq_id`` still needs so that it can hold ``num_tokens`` tokens in total
        (its table starting with `hit`'s blocks, if given)."""
        have = len(self._block_tables.get(seq_id, ())) + len(hit.block_ids)
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, seq_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        return self.num_missing_blocks(seq_id, num_tokens, hit) <= self._num_available(hit)

    def allocate(self, seq_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> list[int]:
        """Grows ``seq_id``'s table to hold ``num_tokens`` tokens; returns the new (fresh) block
        ids. `hit`: what `find_cached_prefix` just found for this sequence, which has no table yet
        (nothing allocated or freed since the lookup); its blocks start the table."""
        if hit.num_queried_tokens:
            self._check_hit(seq_id, hit)
        missing = self.num_missing_blocks(seq_id, num_tokens, hit)
        available = self._num_available(hit)
        if missing > available:
            raise RuntimeError(
                f"cannot allocate {missing} blocks for {seq_id}: only {available} free (call can_allocate first)"
            )
        if hit.num_queried_tokens:
            self._pool.share(hit.cached_block_ids)
            self._pool.share_held(hit.in_flight_block_ids)
            self._block_tables[seq_id] = list(hit.block_ids)
            self._num_registered[seq_id] = len(hit.cached_block_ids)
            self.num_prefix_queried_tokens += hit.num_queried_tokens
            self.num_prefix_hit_tokens += hit.num_tokens
        new_ids = self._pool.take(missing)
        self._block_tables.setdefault(seq_id, []).extend(new_ids)
        return new_ids

    def free(self, seq_id: str) -> int:
        """Drops ``seq_id``'s hold on all its blocks (blocks other sequences share stay theirs);
        returns how many blocks it held."""
        table = self._block_tables.pop(seq_id, [])
        self._drop_claims(seq_id, self._claims.pop(seq_id, ()))
        self._block_hashes.pop(seq_id, None)
        self._num_registered.pop(seq_id, None)
        self._pool.release(table)
        return len(table)

    # ---- prefix caching ----------------------------------------------------------------------

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> PrefixHit:
        """The longest run of cached blocks that ``seq_id``'s tokens start with, stopping short of
        the block holding its last token (always computed); changes nothing but a memo of the
        sequence's hashes. The hit names the sequence computing the first missing block, if another
        one claimed it (`claim_uncomputed_blocks`). `NO_HIT` with prefix caching off."""
        if self._hasher is None:
            return NO_HIT
        size = self.block_size
        hashes = self._block_hashes.setdefault(seq_id, [])
        block_ids: list[int] = []
        computing_by = None
        for i in range((len(token_ids) - 1) // size):
            self._hash_through(hashes, token_ids, num_prompt_tokens, i)
            block_id = self._pool.cached_block(hashes[i])
            if block_id is None:
                computing_by = self._computing.get(hashes[i])
                break
            block_ids.append(block_id)
        if computing_by == seq_id:
            computing_by = None
        return PrefixHit(tuple(block_ids), len(block_ids) * size, len(token_ids), computing_by)

    def claim_uncomputed_blocks(self, seq_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> int:
        """Notes that ``seq_id`` (just given its table) will compute its full blocks past its named
        ones (those its table holds and those a later chunk adds), so lookups that miss on them can wait for it; returns how many it claimed.
        A block cached or claimed already stays as it is. Nothing with prefix caching off."""
        if self._hasher is None or seq_id not in self._block_tables:
            return 0
        num_full = len(token_ids) // self.block_size  # its table may not reach them yet (chunked prefill)
        done = self._num_registered.get(seq_id, 0)
        if num_full <= done:
            return 0
        hashes = self._block_hashes.setdefault(seq_id, [])
        if len(hashes) < num_full:
            self._hasher.extend(hashes, token_ids, num_prompt_tokens, num_full)
        claims = self._claims.setdefault(seq_id, [])
        num_claimed = 0
        for block_hash in hashes[done:num_full]:
            if block_hash not in self._computing and self._pool.cached_block(block_hash) is None:
                self._computing[block_hash] = seq_id
                claims.append(block_hash)
                num_claimed += 1
        return num_claimed

    def ride_in_flight(self, seq_id: str, token_ids: Sequence[int], num_prompt_tokens: int, hit: PrefixHit,
                       computed_through: int) -> PrefixHit:
        """`hit` (just found for ``seq_id``) continued with the blocks its claimer (`hit.computing_by`)
        is computing in the step about to run, which computes the claimer's first `computed_through`
        tokens: its table's next blocks while they hold this sequence's prefix too, short of the
        block holding this sequence's last token. The result's `computing_by` names whoever claimed
        the block after those (None if nobody did), as a lookup would; `hit` itself if none ride.
        Changes nothing but the memo of this sequence's hashes."""
        claimer = hit.computing_by
        if self._hasher is None or claimer is None:
            return hit
        size = self.block_size
        hashes = self._block_hashes.setdefault(seq_id, [])
        claimer_table = self._block_tables.get(claimer, [])
        claimer_hashes = self._block_hashes.get(claimer, [])
        limit = min((len(token_ids) - 1) // size, computed_through // size, len(claimer_table), len(claimer_hashes))
        riding: list[int] = []
        index = len(hit.block_ids)
        while index < limit:
            self._hash_through(hashes, token_ids, num_prompt_tokens, index)
            if hashes[index] != claimer_hashes[index] or self._computing.get(hashes[index]) != claimer:
                break
            riding.append(claimer_table[index])
            index += 1
        if not riding:
            return hit
        computing_by = None
        if index < (len(token_ids) - 1) // size:
            self._hash_through(hashes, token_ids, num_prompt_tokens, index)
            computing_by = self._computing.get(hashes[index])
        return PrefixHit(hit.block_ids + tuple(riding), hit.num_tokens + len(riding) * size, hit.num_queried_tokens,
                         None if computing_by == seq_id else computing_by, len(riding))

    def _hash_through(self, hashes: list[bytes], token_ids: Sequence[int], num_prompt_tokens: int, index: int) -> None:
        """Extends a sequence's memo of block hashes so that it holds block `index`'s."""
        if index >= len(hashes):
            self._hasher.extend(hashes, token_ids, num_prompt_tokens, index + 1)

    def _drop_claims(self, seq_id: str, hashes) -> None:
        for block_hash in hashes:
            if self._computing.get(block_hash) == seq_id:
                del self._computing[block_hash]

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                          num_computed_tokens: int) -> int:
        """Names ``seq_id``'s full blocks whose KV is computed (its first ``num_computed_tokens``
        tokens) so later prefixes can reuse them; returns how many were newly cached (a block
        whose prefix another block already holds stays private). Cheap when nothing is new."""
        table = self._block_tables.get(seq_id)
        if self._hasher is None or not table:
            return 0
        # Only blocks whose tokens are all known: a step can count a token as computed before it is
        # appended to `token_ids` (seen under the async engine: 104 computed, 103 tokens).
        num_full = min(min(num_computed_tokens, len(token_ids)) // self.block_size, len(table))
        done = self._num_registered.get(seq_id, 0)
        if num_full <= done:
            return 0
        hashes = self._block_hashes.setdefault(seq_id, [])
        self._hasher.extend(hashes, token_ids, num_prompt_tokens, num_full)
        num_new = sum(self._pool.register(table[i], hashes[i]) for i in range(done, num_full))
        self._num_registered[seq_id] = num_full
        if seq_id in self._claims:
            self._drop_claims(seq_id, hashes[done:num_full])
        return num_new

    def _check_hit(self, seq_id: str, hit: PrefixHit) -> None:
        """Raises `RuntimeError` unless `hit` can start ``seq_id``'s table: it has none yet and each
        hit block still holds the KV its prefix names (no eviction since the lookup)."""
        if self._block_tables.get(seq_id):
            raise RuntimeError(f"{seq_id} already holds blocks: a prefix hit only starts a new table")
        hashes = self._block_hashes.get(seq_id, [])
        cached = hit.cached_block_ids
        if len(hit.block_ids) > len(hashes) or any(
                self._pool.cached_block(block_hash) != block_id for block_hash, block_id in zip(hashes, cached)):
            raise RuntimeError(f"the cached prefix found for {seq_id} is no longer cached: look it up again")
        for block_hash, block_id in zip(hashes[len(cached):], hit.in_flight_block_ids):
            if self._computing.get(block_hash) is None or self._pool.is_cached(block_id):
                raise RuntimeError(f"block {block_id} is no longer in flight for {seq_id}: look the prefix up again")

    def _num_available(self, hit: PrefixHit) -> int:
        """Free blocks left for fresh allocation once `hit`'s blocks are taken back."""
        return self._pool.num_free - self._pool.num_reclaimable(hit.block_ids)
