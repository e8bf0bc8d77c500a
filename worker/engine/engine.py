"""The inference engine: requests in, tokens out, one continuous-batching step at a time.

`Engine` wires the parts together — tokenizer, `Scheduler` over a `BlockManager` (with prefix
caching unless ``EngineConfig.enable_prefix_caching`` is off: its KV blocks named by the checkpoint),
`ModelRunner` with its KV pool and attention backend, `Sampler`, and ``requests``, the
`RequestLifecycle` that holds each admitted request with its `IncrementalDetokenizer` — and
drives the request lifecycle: validate and admit (`add_request`), advance everything one step
(`step`), cancel (`abort`). It is single threaded on purpose; `AsyncEngine` drives it from a
thread for asyncio callers. ``requests`` is also the public surface that moving a request to
another engine is built on (pause, snapshot, adopt, retire, KV blocks in and out:
`worker.transfer.engine_migration`, `worker.transfer.layer_handoff`).

Validation happens at admission (`worker.engine.request_admission`, through `prepare_request`), before
a request touches shared state, so a bad request fails alone with a message naming the problem
and the other requests in the batch never notice. What can still go wrong for one request after
that (its sampling, its stop handling, its detokenizing) fails that request alone too: it
finishes with reason "error" and the cause in its output's ``error``, and the engine keeps serving the others. Only a failure of
the batch itself (the forward pass) escapes `step`; `request_ids_in_step` then names the
requests that were in it, the only ones that can have caused it.

Sampling settings that need the model are applied here: `Sampler` is built with the model's
end-of-sequence ids (``min_tokens`` holds them back), a request with a penalty gets its
`TokenCounts` on its `Sequence` at its first step, and one that asks for ``logprobs`` gets them
from the raw logits of its rows alone, each token's text decoded alone (vLLM's way), in its
`RequestOutput`.

A request with ``structured_output`` (a JSON schema, any JSON object, a regex, a choice) has its
grammar compiled at admission (`check_structured_output`: a spec that cannot be enforced is refused
there, "structured_output: ..."), and every step its rows' logits masked to what the grammar allows
before the sampler sees them (penalties, temperature and greedy alike), the masks computed on a
helper thread while the forward pass runs; its logprobs stay the model's own. It finishes with
"stop" when its grammar accepts the end of the output (even under ``ignore_eos``); a grammar that
fails or refuses a token fails that request alone. Its matcher follows its tokens, so a migrated or
preempted request continues under it (`worker.engine.structured_output_manager`).

An engine can also start before its weights (``Engine(model_dir, config, weights=source)`` with a
`loader.LayerReadiness` source: the SSD/DRAM loader or a peer stream; `model_dir` then needs only
config.json and the tokenizer). It returns at once; requests are admitted and stepped right away,
and their prefills compute each layer as soon as it lands (`worker.loading.layer_gate`), swept zigzag
across requests (`worker.engine.zigzag_prefill`). When the last layer is in, the engine steps as usual.
fp32 CPU weights are pre-packed for oneDNN layer by layer as they land, off the compute thread.

An idle engine can `sleep`: its KV pool is freed, and on a CUDA device its weights move to pinned
host memory (`worker.loading.host_weights`; ``EngineConfig.sleep_offloads_weights`` chooses, once); `wake`
copies them back and builds the pool again. Asleep, it refuses requests (`enqueue`; migrated ones in
`worker.transfer.engine_migration.begin_import`), and packs no weights while they are away.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from kernels import get_attention_backend
from kernels.cpu_linear import cpu_prepack_unavailable_reason
from loader import LayerReadiness
from worker.kv.block_manager import BlockManager
from worker.loading.checkpoint import load_model
from worker.loading.checkpoint_identity import checkpoint_identity
from worker.engine.engine_config import EngineConfig
from worker.engine.generation_defaults import read_eos_ids, read_generation_defaults
from worker.loading.host_weights import HostWeights
from worker.loading.layer_gate import LayerGate, LayerLoadError
from worker.models.model_config import ModelConfig
from worker.models.model_family import build_model
from worker.engine.model_runner import ModelRunner, kv_bytes_per_block
from worker.kv.prefix_hasher import PrefixHasher
from worker.engine.request_admission import RequestAdmission
from worker.engine.request_lifecycle import RequestLifecycle, request_output
from worker.engine.request_output import Completion, RequestOutput
from worker.loading.reserved_memory import ReservedMemory
from worker.engine.sampler import Sampler
from worker.engine.step_logprobs import step_logprobs
from wire.sampling_params import SamplingParams
from worker.engine.engine_stats import EngineStats
from worker.engine.scheduler import Scheduler
from wire import FinishReason
from worker.engine.sequence import Sequence
from worker.engine.structured_output_manager import MaskJob, StructuredOutputManager
from worker.engine.token_counts import TokenCounts
from worker.text.tokenizer import Tokenizer
from worker.models.weight_packing import WeightPacking
from worker.engine.zigzag_prefill import ZigzagPrefill
from wire import Prompt  # noqa: F401 - re-exported: the engine's prompt is the wire's
from wire import InvalidRequestError  # defined in wire: the gateway catches it without importing the engine
from wire import TokenLogprobs

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *,
                 reserved: ReservedMemory | None = None, weights: LayerReadiness | None = None) -> None:
        """`reserved`: host memory faulted ahead of the load (a spare worker's; see
        `worker.loading.reserved_memory`), used for the weights and the KV pool where they fit (CPU only).
        `weights`: a source whose layers are still arriving; the engine returns without waiting for
        them (see the module docstring) and reads no weights from `model_dir`."""
        config = config or EngineConfig()
        self.config = config
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory not found: {self.model_dir}")
        self.model_config = ModelConfig.from_model_dir(self.model_dir, dtype=config.dtype)
        # Read once, now, while the checkpoint's files are certain to be there: a running engine never
        # reads its model dir again (a restarted node store empties its DRAM tier, issue 44).
        self.checkpoint_id = checkpoint_identity(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} was requested but this machine has no usable CUDA device")
        max_positions = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {max_positions}"
            )
        self.max_model_len = config.max_model_len or max_positions
        self.eos_token_ids = frozenset(read_eos_ids(self.model_dir, self.model_config, self.tokenizer))
        # Sampling defaults for the fields a request leaves out (see `worker.engine.generation_defaults`).
        self.generation_defaults = read_generation_defaults(self.model_dir)

        start = self._start_s = time.perf_counter()
        on_cpu = self.device.type == "cpu"
        why_not_prepack = (cpu_prepack_unavailable_reason(self.model_config.torch_dtype, self.device)
                           if config.cpu_weight_prepack else "cpu_weight_prepack is off")
        if why_not_prepack is not None and config.cpu_weight_prepack and on_cpu:
            logger.info("linear weights not pre-packed: %s", why_not_prepack)
        self._gate: LayerGate | None = None
        self.packing: WeightPacking | None = None  # None: not packed, or packed as layers land (the gate)
        self._weights_source = ""
        if weights is None:
            pool = reserved.weights if reserved is not None and on_cpu else None
            model, self._load_report = load_model(self.model_dir, self.model_config, self.device, pool)
            if why_not_prepack is None:  # now, or layer by layer once serving (`worker.models.weight_packing`)
                self.packing = WeightPacking(model, config.cpu_prepack_defer_bytes)
                self._load_report += f"; {self.packing.report}"
            self._load_s: float | None = time.perf_counter() - start
        else:
            with torch.device("meta"):
                model = build_model(self.model_config)
            model.inv_freq = model.inv_freq.to(self.device)  # built real on the CPU, not on meta
            model.eval().requires_grad_(False)
            self._gate = LayerGate(weights, model, device=self.device, timeout_s=config.layer_timeout_s,
                                   prepack_for_cpu=why_not_prepack is None)
            self._weights_source = type(weights).__name__
            self._load_report, self._load_s = "", None

        block_bytes = kv_bytes_per_block(self.model_config, config.block_size, self.model_config.torch_dtype)
        num_blocks = config.num_kv_blocks or config.kv_cache_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} is smaller than one KV block ({block_bytes} bytes)"
            )
        hasher = (PrefixHasher.for_model(self.checkpoint_id, self.model_config, config.block_size)
                  if config.enable_prefix_caching else None)
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_hasher=hasher)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        kv_buffer = (reserved.take_kv_buffer(num_blocks * block_bytes) if reserved is not None and on_cpu else None)
        self.runner = ModelRunner(
            model, self.model_config, num_blocks=num_blocks, block_size=config.block_size, kv_buffer=kv_buffer,
            backend=get_attention_backend(self.device, config.attention_backend), device=self.device,
        )
        self.runner.hold_layers(self._gate)  # None when the weights were loaded up front
        if (self.device.type == "cuda" and config.cuda_graphs and self._gate is None
                and self.runner.backend.name == "triton"):
            # Decode steps replay captured graphs (the Triton kernels read every length from the
            # device; the reference backend reads host lists, which a graph cannot refresh).
            self.runner.enable_decode_graphs(min(config.max_num_seqs, 256), self.max_model_len)
        self.sampler = Sampler(self.eos_token_ids)
        # Grammars for requests with structured_output; its grammar engine is built by the first one.
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                         overlap=config.overlap_structured_output)
        self.admission = RequestAdmission(
            self.tokenizer, self.model_config, max_model_len=self.max_model_len,
            capacity_tokens=self.block_manager.capacity_tokens, device=self.device,
            generation_defaults=self.generation_defaults, structured_output=self.structured_output,
            weights_error=lambda: self.weights_error)
        self._in_step: tuple[str, ...] = ()  # requests of the forward pass under way (see request_ids_in_step)
        self._asleep = False  # the KV pool released (`sleep`)
        # Chosen once: whether sleeping also moves the weights to host memory (`sleep_frees_weights`).
        offload = config.sleep_offloads_weights
        if offload is None:
            offload = self.device.type == "cuda"
        self._host_weights = (HostWeights(model, self.device, pin_memory=self.device.type == "cuda")
                              if offload else None)
        self._zigzag: ZigzagPrefill | None = None
        if self._gate is not None:
            if config.zigzag_prefill:
                self._zigzag = ZigzagPrefill(self.runner, self._gate, self.scheduler,
                                             max_num_tokens=config.max_num_batched_tokens)
            self._gate.start_background()
        # Every request held, admission to retirement; the public surface migration is built on.
        self.requests = RequestLifecycle(self.scheduler, self.runner, self.tokenizer, layer_prefill=self._zigzag)
        logger.info(
            "engine ready: %s (%s, %.1fM params) %s [%s]; %d KV blocks x %d tokens; attention=%s",
            self.model_dir.name, self.model_config.architecture, self.model_config.num_params / 1e6,
            "weights arriving" if self._load_s is None else f"loaded in {self._load_s:.2f} s",
            self.load_report, num_blocks, config.block_size, self.runner.backend.name,
        )

    # ---- weights -----------------------------------------------------------------------------

    @property
    def weights_resident(self) -> bool:
        """Whether every layer's weights are in (always, for an engine that loaded them up front)."""
        return self._gate is None or self._gate.complete

    @property
    def steps_layer_by_layer(self) -> bool:
        """Whether steps still compute layer by layer: the weights are arriving, or prefill passes
        begun before the last layer landed are finishing. A request mid-pass cannot be migrated."""
        return self.runner.layer_gate is not None

    def movable_prefill_ids(self) -> list[str]:
        """Requests whose layer-by-layer prefill waits for a layer still on its way (see
        `ZigzagPrefill.movable_request_ids`); empty once the weights are in."""
        zigzag = self._zigzag
        return zigzag.movable_request_ids() if zigzag is not None else []

    def stats(self) -> EngineStats:
        """This engine's load now (`EngineStats`): what its callers read instead of its parts."""
        scheduler, blocks = self.scheduler, self.block_manager
        return EngineStats(
            num_waiting_requests=scheduler.num_waiting,
            num_running_requests=scheduler.num_running,
            num_kv_blocks=blocks.num_blocks,
            num_free_kv_blocks=blocks.num_free_blocks,
            block_size=blocks.block_size,
            num_preemptions=scheduler.num_preemptions,
            num_prefix_cache_queried_tokens=blocks.num_prefix_queried_tokens,
            num_prefix_cache_hit_tokens=blocks.num_prefix_hit_tokens,
        )

    @property
    def weights_error(self) -> LayerLoadError | None:
        """Why the weights can never be complete (their source failed); the engine then refuses work."""
        return None if self._gate is None else self._gate.error

    @property
    def load_s(self) -> float | None:
        """Seconds from the start of the engine until every weight was resident; None while they arrive."""
        if self._load_s is None and self._gate is not None and self._gate.completed_at is not None:
            self._load_s = self._gate.completed_at - self._start_s
        return self._load_s

    @property
    def load_report(self) -> str:
        """How the weights were read, in one line (for the startup log and the instance's stats)."""
        gate = self._gate
        if gate is None:
            return self._load_report
        how = f"layer by layer from {self._weights_source}"
        prepacked = (f"; {gate.num_prepacked} linear layers pre-packed for oneDNN as they landed"
                     if gate.prepack_for_cpu else "")
        if self.load_s is not None:
            return (f"{how}: {gate.num_layers + 2} layers, the last landed {self.load_s:.2f} s after the start"
                    f"{prepacked}")
        if gate.error is not None:
            return f"{how}: failed after {gate.frontier} of {gate.num_layers + 2} layers: {gate.error}"
        return f"{how}: {gate.frontier} of {gate.num_layers + 2} layers resident so far"

    # ---- admission -------------------------------------------------------------------------

    def prepare_request(self, prompt: Prompt, params: SamplingParams | None = None,
                        request_id: str | None = None) -> Sequence:
        """Validates and tokenizes a request without touching engine state (thread-safe):
        `tokenize_prompt`, then `prepare_tokens`."""
        return self.prepare_tokens(self.tokenize_prompt(prompt), params, request_id)

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """`RequestAdmission.tokenize_prompt`: the prompt's ids, checked alone (thread-safe)."""
        return self.admission.tokenize_prompt(prompt)

    def prepare_tokens(self, prompt_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> Sequence:
        """`RequestAdmission.prepare_tokens`: the request's `Sequence` (thread-safe)."""
        return self.admission.prepare_tokens(prompt_ids, params, request_id)

    def check_params(self, params: SamplingParams) -> None:
        """`RequestAdmission.check_params`: the checks of `params` that need the model."""
        self.admission.check_params(params)

    def check_structured_output(self, params: SamplingParams) -> None:
        """`RequestAdmission.check_structured_output` (thread-safe)."""
        self.admission.check_structured_output(params)

    def enqueue(self, seq: Sequence) -> None:
        """Admits a prepared request to the scheduler's queue."""
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        if self._asleep:  # its instance refuses requests first; this is the backstop
            raise RuntimeError("the engine is asleep (its KV pool is released); wake it first")
        self.requests.admit(seq)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validates and queues a request; returns its id. Raises `InvalidRequestError`."""
        seq = self.prepare_request(prompt, params, request_id)
        self.enqueue(seq)
        return seq.request_id

    # ---- running ---------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def weights_to_pack(self) -> bool:
        """Whether layers of deferred packing (`worker.models.weight_packing`) are still plain and can be
        packed now (not while asleep with the weights moved to host memory)."""
        return (self.packing is not None and not self.packing.done
                and (self._host_weights is None or not self._host_weights.on_host))

    def pack_weights_when_free(self) -> int:
        """Packs the next plain layer (`weights_to_pack`) unless a request waits for its first
        token; returns how many linear modules it packed. Called between steps and while idle."""
        if not self.weights_to_pack or self.scheduler.awaits_first_token():
            return 0
        return self.packing.pack_next()

    @property
    def asleep(self) -> bool:
        """Its KV pool is released (`sleep`): it takes no request until `wake`."""
        return self._asleep

    @property
    def sleep_frees_weights(self) -> bool:
        """Whether `sleep` also moves the weights off the device into host memory (chosen when the
        engine is built, ``EngineConfig.sleep_offloads_weights``): asleep, such an engine holds
        none of its device's memory; otherwise its weights stay where they are."""
        return self._host_weights is not None

    @property
    def host_weights(self) -> HostWeights | None:
        """The weights' moves to host memory and back (bytes, seconds; read them, don't move them),
        None where sleep keeps the weights in place."""
        return self._host_weights

    def sleep(self) -> int:
        """Frees the KV pool of an idle engine, so waking costs a zeroed pool, not a load (issue
        38's sleep), and where `sleep_frees_weights` moves the weights to host memory (pinned on
        CUDA) too, freeing their device copy; otherwise they stay as they are (packed on CPU).
        Captured decode graphs go with the pool. Refused while any request is held or weights are
        still arriving. Returns the device bytes freed: the pool's, plus the weights' when moved."""
        if self._asleep:
            return 0
        if len(self.requests) or self.has_unfinished_requests() or not self.weights_resident:
            raise RuntimeError("the engine has requests in flight or weights still arriving; it cannot sleep")
        self.block_manager.forget_cached()
        self._asleep = True
        freed = self.runner.release_kv_pool()
        if self._host_weights is not None:
            try:
                freed += self._host_weights.offload()
            except BaseException:  # no host memory for them, say: awake again, as it was
                self.runner.restore_kv_pool()
                self._asleep = False
                raise
        return freed

    def wake(self) -> None:
        """Copies moved weights back to the device, then builds the KV pool (and, on CUDA, fresh
        decode graphs, captured on first use at the weights' new addresses); the engine takes
        requests."""
        if not self._asleep:
            return
        if self._host_weights is not None:
            self._host_weights.restore()
        self.runner.restore_kv_pool()
        self._asleep = False

    def step(self) -> list[RequestOutput]:
        """Schedules, runs one forward pass, samples; returns news for requests that got a token.
        While weights are arriving, a step may instead advance prefills through the layers that are
        in and then wait for the next layer (at most ``layer_timeout_s``); it raises
        `LayerLoadError`, after failing every request, if the weights cannot arrive."""
        if self.steps_layer_by_layer:
            return self._step_while_loading()
        return self._step_batch()

    @property
    def request_ids_in_step(self) -> tuple[str, ...]:
        """The requests of the forward pass under way, or of the one that raised out of `step`
        (empty between steps that went well): when a step fails, the suspects."""
        return self._in_step

    def _step_batch(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self._in_step = tuple(seq.request_id for seq in batch.seqs)
        block_tables = [self.block_manager.block_table(seq.request_id) for seq in batch.seqs]
        # The rows that will sample (the runner's rule): their grammar masks, if any, are filled on
        # a helper thread while the forward pass runs (`worker.engine.structured_output_manager`).
        masks = self.structured_output.begin([seq for seq, num_new in zip(batch.seqs, batch.num_new_tokens)
                                              if seq.num_computed_tokens + num_new == seq.num_tokens])
        try:
            logits, sample_indices = self.runner.execute(batch, block_tables)
        except BaseException:
            if masks is not None:
                masks.wait()
            self.scheduler.unwind_riders(batch)  # they started on KV this pass never computed
            raise
        self._in_step = ()
        self.scheduler.update_from_output(batch)
        return self._sample(logits, [batch.seqs[i] for i in sample_indices], masks)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], masks: MaskJob | None = None
                ) -> list[RequestOutput]:  # logits: [S, V]
        """One token per sequence, each appended; a sequence whose sampling or appending fails
        finishes with reason "error" and the rest carry on (see the module docstring). `masks`: the
        grammar masks begun for these rows (made here, inline, if None)."""
        if not seqs:
            return []
        outputs: list[RequestOutput] = []
        raw_logits = logits  # the logprobs are the model's own, before any mask
        if masks is None or masks.seqs != seqs:
            if masks is not None:
                masks.wait()
            masks = self.structured_output.begin(seqs, overlap=False)
        if masks is not None:
            if any(seqs[i].params.logprobs is not None for i in masks.rows):
                logits = logits.clone()
            masks.apply(logits)  # [S, V]: what the grammars disallow is -inf, before penalties and temperature
            if masks.failed:  # these requests' grammars failed: they end, the others are sampled
                outputs = [self._fail(seqs[i], "structured output", exc) for i, exc in masks.failed.items()]
                keep = [i for i in range(len(seqs)) if i not in masks.failed]
                index = torch.tensor(keep, dtype=torch.long, device=logits.device)  # [K]
                logits, raw_logits = logits[index], raw_logits[index]
                seqs = [seqs[i] for i in keep]
                if not seqs:
                    return outputs
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        # A batch draw that fails half-way has advanced some rows' generators; put them back, so
        # the rows that redraw one by one below take the same tokens they would have taken.
        states = [g.get_state() if g is not None and not p.is_greedy else None for p, g in zip(params, generators)]
        try:
            token_ids: list[int | BaseException] = list(self.sampler.sample(
                logits, params, generators, num_output_tokens=[s.num_output_tokens for s in seqs],
                token_counts=[self._token_counts(s) for s in seqs]))
        except Exception:  # noqa: BLE001 - find the row at fault, fail it alone
            token_ids = []
            for row, (seq, state) in enumerate(zip(seqs, states)):
                if state is not None:
                    seq.generator.set_state(state)
                try:
                    token_ids.extend(self.sampler.sample(
                        logits[row:row + 1], [seq.params], [seq.generator], num_output_tokens=[seq.num_output_tokens],
                        token_counts=[self._token_counts(seq)]))
                except Exception as exc:  # noqa: BLE001
                    token_ids.append(exc)
        logprobs = step_logprobs(self.sampler, self.tokenizer, raw_logits, seqs, token_ids)
        for seq, token_id, token_logprobs in zip(seqs, token_ids, logprobs):
            if isinstance(token_id, BaseException):
                outputs.append(self._fail(seq, "sampling", token_id))
                continue
            if isinstance(token_logprobs, BaseException):
                outputs.append(self._fail(seq, "logprobs", token_logprobs))
                continue
            try:
                complete = seq.params.structured_output is not None and self.structured_output.accept(seq, token_id)
            except Exception as exc:  # noqa: BLE001 - a token its grammar refuses: this request alone
                outputs.append(self._fail(seq, "structured output", exc))
                continue
            try:
                outputs.append(self._append(seq, token_id, token_logprobs, complete))
            except Exception as exc:  # noqa: BLE001 - stop handling or detokenizing: this request's alone
                outputs.append(self._fail(seq, "stop handling or detokenizing", exc))
        return outputs

    def _token_counts(self, seq: Sequence) -> TokenCounts | None:
        """The request's penalty counts, up to date with its output (made at its first step); None
        without a penalty."""
        params = seq.params
        if not params.has_penalties:
            return None
        if seq.token_counts is None:
            prompt = seq.prompt_token_ids if params.repetition_penalty != 1.0 else None
            seq.token_counts = TokenCounts(self.model_config.vocab_size, self.device, prompt)
        seq.token_counts.update(seq.token_ids, start=seq.num_prompt_tokens)
        return seq.token_counts

    def _fail(self, seq: Sequence, stage: str, exc: BaseException) -> RequestOutput:
        """Finishes one request with reason "error" (its output's ``error`` says why), freeing its
        blocks; the engine and the other requests go on."""
        logger.error("request %s failed in %s: %s: %s", seq.request_id, stage, type(exc).__name__, exc)
        if seq.request_id in self.requests:
            self.requests.retire(seq.request_id, FinishReason.ERROR)
        return RequestOutput(request_id=seq.request_id, new_token_ids=(), new_text="", finished=True,
                             finish_reason=FinishReason.ERROR.value, num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                             error=f"{stage} failed: {type(exc).__name__}: {exc}")

    def _step_while_loading(self) -> list[RequestOutput]:
        gate, zigzag = self._gate, self._zigzag
        if gate.complete and (zigzag is None or zigzag.num_in_flight == 0):
            self.runner.hold_layers(None)  # from now on the forward pass checks nothing
            self._zigzag = None
            logger.info("weights resident: %s", self.load_report)
            return self._step_batch()
        try:
            if zigzag is not None:
                return self._sample(*zigzag.step())
            return self._step_batch()  # one batch, blocking at each missing layer inside the forward pass
        except LayerLoadError:
            for request_id in self.requests.request_ids():
                self.requests.retire(request_id, FinishReason.ABORT)
            raise

    def _append(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None = None,
                complete: bool = False) -> RequestOutput:
        """`complete`: the request's grammar accepted `token_id` as its end (an end-of-sequence token
        where the output is whole): it stops, even under ``ignore_eos``."""
        detokenizer = self.requests.detokenizer(seq.request_id)
        seq.append_token(token_id)
        params = seq.params
        reason: FinishReason | None = None
        if (complete or token_id in params.stop_token_ids
                or (not params.ignore_eos and token_id in self.eos_token_ids)):
            # The token that ends the request adds no text (vLLM's rule): with special tokens
            # kept, an end-of-sequence token would otherwise end the output with its name.
            text = ""
            reason = FinishReason.STOP
        else:
            text = detokenizer.append(token_id)
            if detokenizer.stopped:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is not None:
            if not detokenizer.stopped:
                text += detokenizer.flush()
            self.requests.retire(seq.request_id, reason)
        return request_output(seq, (token_id,), text, None if logprobs is None else (logprobs,))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request wherever it is; its KV blocks are freed at once. None if unknown."""
        if request_id not in self.requests:
            return None
        return self.requests.retire(request_id, FinishReason.ABORT)

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Runs a batch of prompts to completion (offline use, tests, benchmarks)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        seqs = [self.prepare_request(p, sp) for p, sp in zip(prompts, params_list)]
        for seq in seqs:
            self.enqueue(seq)
        texts: dict[str, list[str]] = {seq.request_id: [] for seq in seqs}
        logprobs: dict[str, list[TokenLogprobs]] = {seq.request_id: [] for seq in seqs}
        wanted = set(texts)
        while any(request_id in self.requests for request_id in wanted):
            for out in self.step():
                if out.request_id in texts:
                    texts[out.request_id].append(out.new_text)
                    logprobs[out.request_id].extend(out.logprobs or ())
            self.pack_weights_when_free()
        return [
            Completion(
                request_id=seq.request_id,
                output_token_ids=tuple(seq.output_token_ids),
                text="".join(texts[seq.request_id]),
                finish_reason=seq.finish_reason.value,
                num_prompt_tokens=seq.num_prompt_tokens,
                logprobs=tuple(logprobs[seq.request_id]) if seq.params.logprobs is not None else None,
            )
            for seq in seqs
        ]

