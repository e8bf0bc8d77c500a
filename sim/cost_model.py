"""The simulator's cost model: how long loads, prefills, decode steps and migrations take.

Every figure is a constant of `CostModel` (or `GpuSpec`) with its source next to it. Three kinds
of source: vendor datasheets (peak bandwidths and FLOP/s), this repository's own measurements
(BENCHMARKS.md, "GPU suite" on a lent H100 80GB HBM3 machine, "Live migration pause"), and
published serving numbers (cited where used). Where none exists the constant says "assumption".

The formulas (a roofline with fitted overheads, per accelerator):

- load: `weight_bytes / bandwidth(tier)`; fixed start-up costs are separate constants
  (`engine_start_s` for a pre-started worker, `process_start_s` for a fresh process).
- decode step (memory-bound): bytes = weights + batch x context x KV bytes/token, FLOPs =
  2 x params x batch + 4 x layers x attention dim x batch x context; step =
  max(bytes / (HBM bw x `decode_bw_efficiency`), FLOPs / (peak x `compute_efficiency`))
  + `step_overhead_s` + `per_sequence_s` x batch. The efficiency and overhead are fitted through
  two measured points (see the constants); attention FLOPs are included, attention's own
  memory traffic is the KV term.
- prefill (compute-bound): FLOPs = 2 x params x tokens + 2 x layers x attention dim x tokens^2
  (causal attention, QK^T and PV); time = max(FLOPs / (peak x `prefill_efficiency`), the
  weights' read) + `step_overhead_s`.
- A model too big for one accelerator runs tensor-parallel on `accelerators_needed(model, gpu)`
  accelerators of one node (1, 2, 4 or 8, the degrees vLLM supports for these head counts):
  bytes and FLOPs divide by that count; decode adds two all-reduces per layer
  (`tp_allreduce_s` each), prefill loses `tp_prefill_comm_fraction` of its time to all-reduce.
  A model that does not fit 8 accelerators raises ValueError (multi-node serving is not modelled).
- migration: the pause a migrated request sees beyond a normal decode step, as a multiple of
  that step, measured by bench/migration.py; the background KV copy is `kv_transfer_s`.

Each formula is written once (`_decode_step_s`, `_prefill_s`). The simulator calls them millions
of times a day simulated, so `instance_costs(model, gpu)` gives one model's pair with its shape
worked out once and prefill memoised by prompt length: the same arithmetic, the same floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from sim.sim_models import SimModel

__all__ = ["GpuSpec", "CostModel", "InstanceCosts", "H100", "A100", "H200", "LOAD_TIERS", "MIGRATION_METHODS",
           "default_cost_model"]

LOAD_TIERS = ("gpu", "dram", "ssd", "remote", "s3")
MIGRATION_METHODS = ("kv", "tokens", "restart")
TP_DEGREES = (1, 2, 4, 8)

# Llama-3-8B's figures per parameter, used for a SimModel whose shape is unknown (fields 0).
_FALLBACK_KV_BYTES_PER_PARAM = 131072 / 8.03e9
_FALLBACK_LAYERS_PER_SQRT_PARAM = 32 / math.sqrt(8.03e9)
_FALLBACK_ATTENTION_DIM_PER_SQRT_PARAM = 4096 / math.sqrt(8.03e9)


def _positive(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator kind: memory, memory bandwidth and dense bf16 peak."""

    name: str
    hbm_bytes: int
    hbm_bw_Bps: float
    bf16_flops: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GpuSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.hbm_bytes, int) or isinstance(self.hbm_bytes, bool) or self.hbm_bytes <= 0:
            raise ValueError(f"GpuSpec {self.name}: hbm_bytes must be an int > 0, got {self.hbm_bytes!r}")
        _positive(f"GpuSpec {self.name}", "hbm_bw_Bps", self.hbm_bw_Bps)
        _positive(f"GpuSpec {self.name}", "bf16_flops", self.bf16_flops)


# NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16 (1,979 with sparsity).
H100 = GpuSpec(name="H100-SXM-80GB", hbm_bytes=80 * 10**9, hbm_bw_Bps=3.35e12, bf16_flops=989e12)
# NVIDIA A100 SXM datasheet: 80 GB HBM2e, 2,039 GB/s, 312 TFLOP/s dense bf16.
A100 = GpuSpec(name="A100-SXM-80GB", hbm_bytes=80 * 10**9, hbm_bw_Bps=2.039e12, bf16_flops=312e12)
# NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16 (same die as H100).
H200 = GpuSpec(name="H200-SXM-141GB", hbm_bytes=141 * 10**9, hbm_bw_Bps=4.8e12, bf16_flops=989e12)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Bandwidths (bytes/s), efficiencies and fixed times; see the module docstring."""

    # --- load bandwidths into an accelerator, by where the weights come from -------------------
    # "gpu": a peer GPU on the same node over NVLink 4 (H100 SXM datasheet: 900 GB/s
    # bidirectional = 450 GB/s each way); 80% of it assumed reachable by NCCL point-to-point.
    # Not measured here: the lent machines have one GPU (BENCHMARKS.md, GPU suite).
    gpu_peer_Bps: float = 360e9
    # "dram": the node's DRAM tier through Thaw's loader, measured on the lent H100 machine
    # (BENCHMARKS.md, GPU suite, "Loading to the GPU": 15.8 GB/s; 17.9 GB/s in a later run).
    # The PCIe Gen5 x16 link itself measured 52.7 GB/s pinned (64 GB/s spec); the loader's
    # reader threads, not the link, are the limit.
    dram_Bps: float = 15.8e9
    # A sleeper's wake on a slot host (`sim.sim_host`): its weights, kept in pinned host memory,
    # copied back over its GPU's PCIe Gen5 x16 link, at the 52.7 GB/s measured pinned in the same
    # run; no loader and no engine start (the engine was kept).
    host_link_Bps: float = 52.7e9
    # "ssd": the node's NVMe tier, page cache dropped, same run (1.52 GB/s; 1.77 later).
    ssd_Bps: float = 1.52e9
    # "remote": streamed from a peer on another node. 100 Gb/s RDMA per GPU, the low end of the
    # 100-400 Gb/s inter-node links BlitzScale (OSDI'25, arXiv 2412.17246) loads parameters over;
    # 90% goodput assumed. Not measured here (no multi-node GPU machine).
    remote_Bps: float = 100e9 / 8 * 0.9
    # "s3": the model repository (object store). Our only measurement is the repository fetch on
    # the developers' VM (BENCHMARKS.md, "Load time per storage tier": 0.28-0.35 GB/s including
    # conversion); the controller's own fallback is 0.2 GB/s. 0.35 GB/s taken; a datacenter S3
    # endpoint with parallel ranged reads may be faster (ServerlessLLM, arXiv 2401.14351, assumes
    # 5 GB/s downloads): change it to study that.
    s3_Bps: float = 0.35e9

    # --- fixed start-up times ------------------------------------------------------------------
    # A pre-started (spare) worker: engine construction to first token beyond the weight copy.
    # BENCHMARKS.md, GPU suite, "Cold start on the GPU": 0.495 s from the DRAM tier for 2.08 GB,
    # of which 2.08 GB / 15.8 GB/s = 0.13 s is the copy -> 0.36 s.
    engine_start_s: float = 0.36
    # A fresh process (Python, torch import, CUDA context) before it can load anything: the same
    # section's baseline took 18.29 s, of which 23.8 x 0.495 = 11.8 s came after its imports
    # ("from after the baseline's imports the ratios are 23.8x") -> 6.5 s. Ray-Serve-like replicas pay it on every start.
    process_start_s: float = 6.5

    # --- compute -------------------------------------------------------------------------------
    # Decode: fitted through two measured batch-1 steps: Thaw's engine, 0.39B bf16 model on the
    # lent H100, 2.45 ms (BENCHMARKS.md, GPU suite, "Engine on the GPU"); vLLM, Llama-3.1-8B bf16
    # on an A100 40GB (1.555 TB/s), 75 tok/s = 13.3 ms (johnmusgrave.com, "vLLM throughput-latency
    # sweep on NVIDIA A100", vLLM 0.23, 1024-token prompts). With `per_sequence_s` and the KV term, 0.90
    # and 2.2 ms give 2.49 ms (+2%) and 13.8 ms (+4%).
    decode_bw_efficiency: float = 0.90
    step_overhead_s: float = 2.2e-3
    # Per sequence in the batch: the same engine measured 3.39 ms at batch 32 against 2.45 ms at
    # batch 1 for a weight read that did not change -> (3.39 - 2.45) / 31 = 0.03 ms.
    per_sequence_s: float = 3.0e-5
    # Decode's FLOP term (it only binds at large batches): assumption, tensor-core GEMMs at half
    # of peak, as for prefill.
    compute_efficiency: float = 0.5
    # Prefill: NVIDIA's GH200 NVL32 post reports Llama-3.1-70B, 32,768 input tokens, TTFT 472 ms
    # on 32 GPUs: 6.0e15 FLOP by the formula above = 40% of their 989 TFLOP/s peak, with 32-way
    # communication. One accelerator without it: 50% assumed.
    prefill_efficiency: float = 0.5

    # --- tensor parallelism --------------------------------------------------------------------
    # vLLM's default gpu_memory_utilization: the share of an accelerator's memory it takes.
    gpu_memory_utilization: float = 0.9
    # KV-cache room required next to the weights, as a share of one accelerator's memory, for a
    # model to count as fitting (assumption: ~8 GB on an 80 GB GPU, 60k tokens of Llama-3-8B).
    min_kv_fraction: float = 0.1
    # One all-reduce of a decode step's activations over NVLink (assumption: NCCL small-message
    # latency on one node is ~10-20 us; 15 us taken). Two per layer (attention, MLP).
    tp_allreduce_s: float = 15e-6
    # Share of prefill time spent in all-reduce at TP=4 on one 8xH100 NVSwitch node: 25.5%
    # (ISC High Performance 2026 poster, Llama-3.3-70B on vLLM, "TP=4 reduces this to 25.5%").
    tp_prefill_comm_fraction: float = 0.255

    # --- live migration (BENCHMARKS.md, "Live migration pause", re-run 2026-11-24) -------------
    # Largest gap a migrated request saw, as a multiple of the normal decode gap: KV-based
    # 1.43-1.61x, token-based (ServerlessLLM-style) 1.92-2.27x; the largest of each taken.
    kv_pause_factor: float = 1.61
    token_pause_factor: float = 2.27

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive("CostModel", f.name, getattr(self, f.name))
        for name in ("decode_bw_efficiency", "compute_efficiency", "prefill_efficiency", "gpu_memory_utilization"):
            if getattr(self, name) > 1:
                raise ValueError(f"CostModel.{name} is a fraction of peak: set it in (0, 1], got {getattr(self, name)!r}")
        if self.min_kv_fraction >= self.gpu_memory_utilization:
            raise ValueError(f"CostModel.min_kv_fraction ({self.min_kv_fraction}) must be below "
                             f"gpu_memory_utilization ({self.gpu_memory_utilization}): no room would be left for weights")
        if self.tp_prefill_comm_fraction >= 1:
            raise ValueError(f"CostModel.tp_prefill_comm_fraction must be in (0, 1), got {self.tp_prefill_comm_fraction!r}")
        for name in ("kv_pause_factor", "token_pause_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"CostModel.{name} is the pause as a multiple of a normal decode step: set it >= 1, "
                                 f"got {getattr(self, name)!r}")

    # --- loads -----------------------------------------------------------------------------------

    def tier_Bps(self, tier: str) -> float:
        """The load bandwidth of `tier` (one of LOAD_TIERS), bytes/s."""
        rates = {"gpu": self.gpu_peer_Bps, "dram": self.dram_Bps, "ssd": self.ssd_Bps,
                 "remote": self.remote_Bps, "s3": self.s3_Bps}
        if tier not in rates:
            raise ValueError(f"unknown load tier {tier!r}; use one of {LOAD_TIERS}")
        return rates[tier]

    def load_s(self, weight_bytes: int, tier: str) -> float:
        """Seconds to bring `weight_bytes` into accelerator memory from `tier`; start-up costs
        (`engine_start_s`, `process_start_s`) are not included."""
        if isinstance(weight_bytes, bool) or not isinstance(weight_bytes, (int, float)) \
                or not math.isfinite(weight_bytes) or weight_bytes < 0:
            raise ValueError(f"weight_bytes must be a finite number >= 0, got {weight_bytes!r}")
        return weight_bytes / self.tier_Bps(tier)

    # --- placement -------------------------------------------------------------------------------

    def accelerators_needed(self, model: SimModel, gpu: GpuSpec) -> int:
        """The tensor-parallel degree (1, 2, 4 or 8) whose per-accelerator weight share leaves
        `min_kv_fraction` of memory for the KV cache within `gpu_memory_utilization`."""
        usable = gpu.hbm_bytes * (self.gpu_memory_utilization - self.min_kv_fraction)
        for degree in TP_DEGREES:
            if model.weight_bytes / degree <= usable:
                return degree
        raise ValueError(f"model {model.model_id} ({model.weight_bytes / 1e9:.1f} GB of weights) does not fit "
                         f"{TP_DEGREES[-1]} x {gpu.name} ({gpu.hbm_bytes / 1e9:.0f} GB each); multi-node serving is "
                         f"not modelled: use a larger GPU kind or a smaller model")

    def instance_memory_bytes(self, model: SimModel, gpu: GpuSpec, kv_pool_tokens: int) -> int:
        """What one instance takes of each of its accelerators' memory on a slot host (`sim.sim_host`):
        its weights and a KV pool of `kv_pool_tokens` tokens, both split over its tensor-parallel
        degree."""
        degree = self.accelerators_needed(model, gpu)
        return math.ceil((model.weight_bytes + self.kv_bytes_per_token(model) * kv_pool_tokens) / degree)

    def kv_bytes_per_token(self, model: SimModel) -> int:
        """One token's KV cache over all layers (the model's own figure, else Llama-3-8B's per parameter)."""
        return self._shape(model)[2]

    def wake_s(self, model: SimModel, gpu: GpuSpec) -> float:
        """Seconds for an instance asleep on a slot host to serve again: each of its accelerators
        copies its share of the weights back from pinned host memory over its own link."""
        return model.weight_bytes / self.accelerators_needed(model, gpu) / self.host_link_Bps

    # --- compute ---------------------------------------------------------------------------------

    @staticmethod
    def _shape(model: SimModel) -> tuple[int, int, int]:
        params = model.params_b * 1e9
        layers = model.num_layers or max(1, round(_FALLBACK_LAYERS_PER_SQRT_PARAM * math.sqrt(params)))
        attention_dim = model.attention_dim or max(64, round(_FALLBACK_ATTENTION_DIM_PER_SQRT_PARAM * math.sqrt(params)))
        kv = model.kv_bytes_per_token or max(1, round(_FALLBACK_KV_BYTES_PER_PARAM * params))
        return layers, attention_dim, kv

    def decode_step_s(self, model: SimModel, gpu: GpuSpec, batch: int, context_tokens: float) -> float:
        """Seconds for one decode step of `batch` sequences whose mean context (prompt + tokens
        generated so far) is `context_tokens`."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        if not math.isfinite(context_tokens) or context_tokens < 0:
            raise ValueError(f"context_tokens must be a finite number >= 0, got {context_tokens!r}")
        return _decode_step_s(self, _Shape.of(self, model, gpu), gpu, batch, context_tokens)

    def prefill_s(self, model: SimModel, gpu: GpuSpec, tokens: int) -> float:
        """Seconds to prefill one prompt of `tokens` tokens (to its first output token)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
        return _prefill_s(self, _Shape.of(self, model, gpu), gpu, tokens)

    def instance_costs(self, model: SimModel, gpu: GpuSpec, *, memoise: bool = True) -> "InstanceCosts":
        """`decode_step_s` and `prefill_s` of one model on one GPU kind, for the simulator's hot
        path: the model's shape worked out once, no argument checks, prefill memoised by prompt
        length. The same formulas in the same order, so the same floats as the checked methods
        (`memoise=False`: the checked methods themselves, the reference the tests compare with)."""
        return InstanceCosts(self, model, gpu, memoise=memoise)

    # --- migration -------------------------------------------------------------------------------

    def migration_pause_s(self, model: SimModel, gpu: GpuSpec, batch: int, context_tokens: float,
                          method: str = "kv") -> float:
        """Stall beyond a normal decode step that `batch` migrated sequences holding
        `context_tokens` KV tokens in all see at the hand-off. "kv": Thaw's staged KV copy
        ((kv_pause_factor - 1) steps); "tokens": ServerlessLLM's multi-round token migration
        ((token_pause_factor - 1) steps; the destination's recompute of the KV is the caller's to
        simulate); "restart": abort and re-prefill every sequence's context on the destination."""
        if method not in MIGRATION_METHODS:
            raise ValueError(f"unknown migration method {method!r}; use one of {MIGRATION_METHODS}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        if not math.isfinite(context_tokens) or context_tokens < 0:
            raise ValueError(f"context_tokens must be a finite number >= 0, got {context_tokens!r}")
        step_s = self.decode_step_s(model, gpu, batch, context_tokens / batch)
        if method == "kv":
            return (self.kv_pause_factor - 1) * step_s
        if method == "tokens":
            return (self.token_pause_factor - 1) * step_s
        per_sequence = max(1, round(context_tokens / batch))
        return batch * self.prefill_s(model, gpu, per_sequence)

    def kv_transfer_s(self, model: SimModel, context_tokens: float, tier: str = "remote") -> float:
        """Seconds to copy `context_tokens` tokens of KV cache over `tier`'s link (the background
        part of a KV migration, overlapped with decoding)."""
        if not math.isfinite(context_tokens) or context_tokens < 0:
            raise ValueError(f"context_tokens must be a finite number >= 0, got {context_tokens!r}")
        return self._shape(model)[2] * context_tokens / self.tier_Bps(tier)


def default_cost_model() -> CostModel:
    """The sourced defaults above (an H100 node as measured on the lent machine)."""
    return CostModel()


class _Shape:
    """What the formulas need of one model on one GPU kind, worked out once."""

    __slots__ = ("degree", "layers", "attention_dim", "kv", "weight_bytes", "params")

    def __init__(self, degree: int, layers: int, attention_dim: int, kv: int, weight_bytes: int, params: float) -> None:
        self.degree = degree
        self.layers = layers
        self.attention_dim = attention_dim
        self.kv = kv
        self.weight_bytes = weight_bytes
        self.params = params

    @classmethod
    def of(cls, cost: CostModel, model: SimModel, gpu: GpuSpec) -> "_Shape":
        layers, attention_dim, kv = CostModel._shape(model)
        return cls(cost.accelerators_needed(model, gpu), layers, attention_dim, kv, model.weight_bytes,
                   model.params_b * 1e9)


def _decode_step_s(cost: CostModel, shape: _Shape, gpu: GpuSpec, batch: int, context_tokens: float) -> float:
    """The decode formula (module docstring); the one place it is written."""
    degree = shape.degree
    kv_tokens = batch * context_tokens
    bytes_read = (shape.weight_bytes + shape.kv * kv_tokens) / degree
    flops = (2 * shape.params * batch + 4 * shape.layers * shape.attention_dim * kv_tokens) / degree
    roofline_s = max(bytes_read / (gpu.hbm_bw_Bps * cost.decode_bw_efficiency),
                     flops / (gpu.bf16_flops * cost.compute_efficiency))
    allreduce_s = 2 * shape.layers * cost.tp_allreduce_s if degree > 1 else 0.0
    return roofline_s + cost.step_overhead_s + cost.per_sequence_s * batch + allreduce_s


def _prefill_s(cost: CostModel, shape: _Shape, gpu: GpuSpec, tokens: int) -> float:
    """The prefill formula (module docstring); the one place it is written."""
    degree = shape.degree
    flops = 2 * shape.params * tokens + 2 * shape.layers * shape.attention_dim * tokens * tokens
    compute_s = max(flops / (gpu.bf16_flops * cost.prefill_efficiency),
                    shape.weight_bytes / (gpu.hbm_bw_Bps * cost.decode_bw_efficiency)) / degree
    if degree > 1:
        compute_s /= 1 - cost.tp_prefill_comm_fraction
    return compute_s + cost.step_overhead_s


class InstanceCosts:
    """`CostModel.instance_costs`: one model's decode step and prefill times, fast and exact."""

    __slots__ = ("decode_step_s", "prefill_s", "_cost", "_shape", "_gpu", "_prefills")

    def __init__(self, cost: CostModel, model: SimModel, gpu: GpuSpec, *, memoise: bool = True) -> None:
        self._cost = cost
        self._shape = _Shape.of(cost, model, gpu)
        self._gpu = gpu
        self._prefills: dict[int, float] = {}
        if memoise:
            self.decode_step_s = self._decode
            self.prefill_s = self._prefill
        else:
            self.decode_step_s = lambda batch, context_tokens: cost.decode_step_s(model, gpu, batch, context_tokens)
            self.prefill_s = lambda tokens: cost.prefill_s(model, gpu, tokens)

    def _decode(self, batch: int, context_tokens: float) -> float:
        return _decode_step_s(self._cost, self._shape, self._gpu, batch, context_tokens)

    def _prefill(self, tokens: int) -> float:
        seconds = self._prefills.get(tokens)
        if seconds is None:
            seconds = self._prefills[tokens] = _prefill_s(self._cost, self._shape, self._gpu, tokens)
        return seconds
