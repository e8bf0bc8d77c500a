"""Turns a scheduled batch into one forward pass over the paged KV cache.

The runner owns the device side: the model, the KV pool (one key and one value tensor of
``[num_blocks, block_size, Hkv, D]`` per layer, carved from a single allocation) and the
attention backend. Per step it flattens the scheduled sequences into a ragged batch, builds
the `AttentionMetadata` once for all layers, and returns logits only for the sequences whose
KV has caught up with their tokens (the ones that sample this step).

It is the one thing that executes the model's layers: a whole step (`execute`, and the decode
graphs it captures from its own `forward`), and for a pass that advances a layer at a time (the
zigzag prefill while weights arrive, a prefill handed over at layer k) its pieces: `embed`,
`execute_layers(first, last, hidden, ...)`, `final_norm`, `compute_logits`. While weights arrive,
each piece first asks the loader's `LayerGate` for its layer (-1 the embedding, k decoder layer
k, L the final norm and head: `hold_layers`), which blocks until that layer is resident; the
model itself knows nothing of it. Without a gate that is one None check per piece.
"""

from __future__ import annotations

import torch

from kernels import AttentionBackend, AttentionMetadata
from worker.engine.decode_graphs import DecodeGraphs
from worker.loading.layer_gate import LayerGate
from worker.models.llama import LlamaForCausalLM
from worker.models.model_config import ModelConfig
from worker.models.rotary_embedding import needs_rope_lengths, rope_lengths_of_span
from worker.engine.scheduler import ScheduledBatch


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
        (memory faulted ahead of time, see `worker.loading.reserved_memory`); None allocates it here."""
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
        self._gate: LayerGate | None = None
        self._graph_limits: tuple[int, int] | None = None  # (max_batch, max_model_len) once enabled
        # longrope picks a token's frequencies by its sequence's length (see `rotary_embedding.py`).
        self._pass_rope_lengths = needs_rope_lengths(config.rope_scaling)

    def enable_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Runs later decode-only steps of up to `max_batch` sequences through CUDA graphs
        (`worker.engine.decode_graphs`); the weights must all be resident by then."""
        self._graph_limits = (max_batch, max_model_len)
        self.decode_graphs = DecodeGraphs(self._decode_logits, max_batch=max_batch, max_model_len=max_model_len,
                                          block_size=self.block_size, device=self.device)

    # ---- the layers ------------------------------------------------------------------------

    @property
    def layer_gate(self) -> LayerGate | None:
        """The gate each piece of a pass asks for its layer while the weights arrive; None once
        they are all in (or were loaded up front)."""
        return self._gate

    def hold_layers(self, gate: LayerGate | None) -> None:
        """From now on each piece of a pass waits for its layer at ``gate`` (None: checks nothing)."""
        self._gate = gate

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T], [T] int64
              rope_lengths: torch.Tensor | None = None,  # [T] int64: see `LlamaForCausalLM.embed`
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # hidden [T, H]; cos, sin: the rope tables
        if self._gate is not None:
            self._gate.ensure(-1)
        return self.model.embed(input_ids, positions, rope_lengths)

    def execute_layers(self, first: int, last: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       metadata: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        """Decoder layers ``first``..``last - 1`` over ``hidden``, the state entering ``first``,
        each writing its KV for the tokens ``metadata`` places."""
        for k in range(first, last):
            if self._gate is not None:
                self._gate.ensure(k)
            hidden = self.model.decoder_layer(k, hidden, cos, sin, self.kv_caches[k], metadata, self.backend)
        return hidden

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if self._gate is not None:
            self._gate.ensure(self.config.num_hidden_layers)
        return self.model.final_norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] normed -> [N, V] float32
        if self._gate is not None:
            self._gate.ensure(self.config.num_hidden_layers)
        return self.model.compute_logits(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T], [T] int64
                metadata: AttentionMetadata, rope_lengths: torch.Tensor | None = None) -> torch.Tensor:  # [T, H]
        """One pass of every layer over a ragged batch of tokens; the final norm's output."""
        hidden, cos, sin = self.embed(input_ids, positions, rope_lengths)
        hidden = self.execute_layers(0, self.config.num_hidden_layers, hidden, cos, sin, metadata)
        return self.final_norm(hidden)

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,  # [n], [n] int64
                       metadata: AttentionMetadata) -> torch.Tensor:  # [n, V] float32: what a decode graph captures
        return self.compute_logits(self.forward(input_ids, positions, metadata))

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
                and self._gate is None and graphs.fits(len(seq_lens), max(seq_lens))):
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
        hidden = self.forward(ids, pos, metadata, lengths)  # [T, H]
        if not sample_rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32), []
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        logits = self.compute_logits(hidden.index_select(0, rows))  # [N, V]
        return logits, sample_seq_indices
