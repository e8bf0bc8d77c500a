"""Turns a scheduled batch into one forward pass over the paged KV cache.

The runner owns the device side: the model, the KV pool (one key and one value tensor of
``[num_blocks, block_size, Hkv, D]`` per layer, carved from a single allocation) and the
attention backend. Per step it flattens the scheduled sequences into a ragged batch, builds
the `AttentionMetadata` once for all layers, and returns logits only for the sequences whose
KV has caught up with their tokens (the ones that sample this step).
"""

from __future__ import annotations

import torch

from kernels import AttentionBackend, AttentionMetadata
from worker.decode_graphs import DecodeGraphs
from worker.llama import LlamaForCausalLM
from worker.model_config import ModelConfig
from worker.rotary_embedding import needs_rope_lengths, rope_lengths_of_span
from worker.scheduler import ScheduledBatch


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
        kv_buffer: torch.Tensor | None = None,
    ) -> None:
        """`kv_buffer`: a zeroed uint8 tensor of exactly the KV pool's bytes to build it in
        (memory faulted ahead of time, see `worker.reserved_memory`); None allocates it here."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.backend = backend
        self.device = device
        dtype = config.torch_dtype
        # [L, 2, num_blocks, block_size, Hkv, D]: one allocation, per-layer views.
        shape = (config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self._pool_shape = shape
        if kv_buffer is not None:
            if kv_buffer.dtype != torch.uint8 or kv_buffer.device != device or \
                    kv_buffer.numel() != num_blocks * kv_bytes_per_block(config, block_size, dtype):
                raise ValueError("kv_buffer must be a uint8 tensor on the runner's device with exactly the KV "
                                 "pool's bytes")
            self.kv_pool = kv_buffer.view(dtype).view(shape)
        else:
            self.kv_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(config.num_hidden_layers)]
        self.decode_graphs: DecodeGraphs | None = None
        self._graph_limits: tuple[int, int] | None = None  # (max_batch, max_model_len) once enabled
        # longrope picks a token's frequencies by its sequence's length (see `rotary_embedding.py`).
        self._pass_rope_lengths = needs_rope_lengths(config.rope_scaling)

    def enable_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Runs later decode-only steps of up to `max_batch` sequences through CUDA graphs
        (`worker.decode_graphs`); the weights must all be resident by then."""
        self._graph_limits = (max_batch, max_model_len)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, max_batch=max_batch,
                                          max_model_len=max_model_len, block_size=self.block_size, device=self.device)

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes the KV pool holds now (0 while released)."""
        return self.kv_pool.numel() * self.kv_pool.element_size()

    def release_kv_pool(self) -> int:
        """Frees the KV pool (an engine going to sleep; every block must be free and forgotten by
        the block manager first). Captured decode graphs read the pool's addresses, so they go
        too. Returns the bytes freed. `restore_kv_pool` builds it again."""
        freed = self.kv_pool_bytes
        self.decode_graphs = None
        self.kv_caches = []
        self.kv_pool = torch.empty(0, dtype=self.config.torch_dtype, device=self.device)
        return freed

    def restore_kv_pool(self) -> None:
        """A zeroed KV pool of the released one's shape (and the decode graphs, if they were on)."""
        if self.kv_pool.numel():
            return
        shape = self._pool_shape  # [L, 2, num_blocks, block_size, Hkv, D]
        self.kv_pool = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(self.config.num_hidden_layers)]
        if self._graph_limits is not None:
            self.enable_decode_graphs(*self._graph_limits)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Runs the batch; returns (logits [N, V] float32, indices into batch.seqs of those N rows)."""
        input_ids: list[int] = []
        positions: list[int] = []
        rope_lengths: list[int] = []  # per token: max(prompt length, position + 1)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seq_indices: list[int] = []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            if self._pass_rope_lengths:
                rope_lengths.extend(rope_lengths_of_span(seq.num_prompt_tokens, start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seq_indices.append(i)
        graphs = self.decode_graphs
        if (graphs is not None and len(sample_rows) == len(batch.seqs) == len(input_ids)
                and self.model.layer_gate is None and graphs.fits(len(seq_lens), max(seq_lens))):
            # Every sequence decodes one token and samples it: one graph replay.
            slots = [table[pos // self.block_size] * self.block_size + pos % self.block_size
                     for table, pos in zip(block_tables, positions)]
            logits = graphs.run(input_ids, positions, slots, block_tables, seq_lens)  # [N, V]
            return logits, sample_seq_indices
        metadata = AttentionMetadata.build(
            block_tables=block_tables, query_lens=query_lens, seq_lens=seq_lens,
            block_size=self.block_size, device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # [T]
        lengths = (torch.tensor(rope_lengths, dtype=torch.int64, device=self.device)  # [T]
                   if self._pass_rope_lengths else None)
        hidden = self.model(ids, pos, self.kv_caches, metadata, self.backend, lengths)  # [T, H]
        if not sample_rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32), []
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [N, V]
        return logits, sample_seq_indices
