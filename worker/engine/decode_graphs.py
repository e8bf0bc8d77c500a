"""CUDA graphs for decode steps: one captured forward pass per padded batch size.

Why: a decode step of a small model on a GPU is mostly launch overhead. Each layer launches a
dozen kernels (norms, GEMMs, RoPE, the KV write, attention, the MLP), each taking microseconds
of CPU time to launch while the GPU finishes it sooner; replaying a captured graph launches the
whole forward pass at once (vLLM and gpt-fast do the same).

A graph replays fixed addresses and fixed launch shapes, so:

* inputs live in static buffers sized for the largest captured batch (token ids, positions,
  KV slots, block tables, context lengths); a step copies its values in and pads the rest with
  rows that write no KV (slot -1) and attend to one token;
* a batch of B sequences runs the graph of the smallest captured size >= B (1, 2, 4, 8, then
  multiples of 16 up to ``max_batch``); larger batches, prefills and mixed steps run eagerly;
* the attention kernel's split count is chosen for the engine's ``max_model_len`` instead of
  the step's longest context (`kernels.triton_decode.choose_num_splits`): splits past a
  sequence's end do no work;
* a size is captured on its first use, not at start, so a cold start's first token never
  waits for captures. The capture's warm-up pass runs the step's real inputs, which writes the
  same K/V into the same slots that the replay writes again: harmless, and it keeps the first
  step of each size exact.

Only for a model whose weights are all resident (no `LayerGate`): a graph cannot wait for a
layer to arrive. What a graph captures is the runner's own decode pass (`ModelRunner.forward`
and its logits), handed in as a function: the runner stays the one thing that executes layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import AttentionMetadata

# (input ids [n], positions [n], metadata) -> logits [n, V] float32: one decode pass of every layer.
DecodePass = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 32, 48, ... up to and including max_batch (rounded up to a multiple of 16
    above 8, so every batch <= max_batch has a size)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    top = max_batch if max_batch <= 8 else -(-max_batch // 16) * 16
    sizes.extend(range(16, top, 16))
    sizes.append(top)
    return tuple(sorted(set(sizes)))


class DecodeGraphs:
    """Runs decode-only steps through captured CUDA graphs (see the module docstring)."""

    def __init__(self, decode_pass: DecodePass, *, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.decode_pass = decode_pass
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [n]
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)  # [n, max_blocks]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [n]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # size -> [size, V] float32, the graph's output
        self._pool = None

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def fits(self, batch_size: int, max_seq_len: int) -> bool:
        return 1 <= batch_size <= self.max_batch and max_seq_len <= self.max_model_len

    def _size_for(self, batch_size: int) -> int:
        return next(s for s in self.sizes if s >= batch_size)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            query_lens_host=(1,) * size, seq_lens_host=(self.max_model_len,) * size,
        )

    def _forward(self, size: int) -> torch.Tensor:  # [size, V] float32
        return self.decode_pass(self.input_ids[:size], self.positions[:size], self._metadata(size))

    def _stage(self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
               seq_lens: list[int], size: int) -> None:
        """Copies one step's inputs into the static buffers; rows past the batch become padding."""
        b = len(token_ids)
        pad = size - b
        width = self.block_tables.shape[1]
        tables = torch.zeros(size, width, dtype=torch.int32)  # [size, width], host
        for row, table in enumerate(block_tables):
            tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        host = torch.tensor([token_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad,
                             seq_lens + [1] * pad], dtype=torch.int64)  # [4, size]
        staged = host.to(self.device, non_blocking=True)
        self.input_ids[:size].copy_(staged[0])
        self.positions[:size].copy_(staged[1])
        self.slot_mapping[:size].copy_(staged[2])
        self.seq_lens[:size].copy_(staged[3].to(torch.int32))
        self.block_tables[:size].copy_(tables.to(self.device, non_blocking=True))

    @torch.inference_mode()
    def run(self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            seq_lens: list[int]) -> torch.Tensor:  # [B, V] float32
        """One decode step of B = len(token_ids) sequences (one new token each)."""
        batch = len(token_ids)
        if not self.fits(batch, max(seq_lens)):
            raise ValueError(f"a decode batch of {batch} sequences up to {max(seq_lens)} tokens does not fit the "
                             f"captured graphs (at most {self.max_batch} sequences, {self.max_model_len} tokens)")
        size = self._size_for(batch)
        self._stage(token_ids, positions, slots, block_tables, seq_lens, size)
        if size not in self._graphs:
            self._capture(size)
        self._graphs[size].replay()
        return self._logits[size][:batch]

    def _capture(self, size: int) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(size)  # compiles the kernels for this shape; writes this step's K/V once
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(size)
        self._graphs[size] = graph
        self._logits[size] = logits
