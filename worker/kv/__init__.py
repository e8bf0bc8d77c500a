"""The paged KV cache's bookkeeping: blocks, their pool, and prefix caching by content.

`block_pool` hands out block ids and keeps the freed-but-cached ones in LRU order; `prefix_hasher`
names a full block by its tokens and everything before it; `block_manager` holds each request's
block table, shares cached prefixes and rides in-flight ones. No tensors: the runner owns the pool.
"""
