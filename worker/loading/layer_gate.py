"""Assigns a model's weights layer by layer as they arrive, so the model can run before they are all in.

BlitzScale (OSDI'25) starts a new instance while its parameters still stream in, layer by layer,
and computes layer k as soon as layer k has landed. `LayerGate` is the worker's half of that: it
wraps a `loader.LayerReadiness` source (the SSD/DRAM loader or a peer stream; the gate cannot
tell them apart) and a `LlamaForCausalLM` built on the ``meta`` device, and `ensure(k)` blocks
until layer k is resident, then assigns its parameters into the model -- only that layer's
submodules, ``load_state_dict(..., assign=True)`` as `worker.loading.checkpoint.load_model` does for the
whole model, through the same renaming (`layer_state_dict`). The model calls `ensure` before each
layer (see `worker.models.llama`); once every layer is in, the engine detaches the gate and the forward
pass is the plain one again.

Assignment (a dtype cast, a copy to the device, the oneDNN pre-pack of fp32 CPU weights) is work,
and compute should never wait for it: `start_background()` runs a thread that assigns each layer
the moment it lands, and `assign_ready()` assigns whatever has landed without blocking, for a
caller that prefers to do it between layers itself. Either way a layer is assigned once: the
threads race for it under one lock and the loser finds it done.

Layers are numbered as in the thaw format: -1 the embedding, 0..N-1 the decoder layers, N the
final norm and head (a tied head is the embedding, so layer N of a tied model also needs -1).
Any failure of the source -- an error, or a layer not in after ``timeout_s`` -- becomes a
`LayerLoadError` naming the layer; it is kept, and every later `ensure` of a missing layer raises
it, so nothing waits on a source that is known to be broken.
"""

from __future__ import annotations

import threading
import time

import torch

from loader import LayerReadiness
from worker.loading.checkpoint import layer_state_dict
from worker.models.llama import LlamaForCausalLM


class LayerLoadError(RuntimeError):
    """A layer's weights never became resident (the source failed or timed out); names the layer."""


class LayerGate:
    def __init__(self, source: LayerReadiness, model: LlamaForCausalLM, *, device: torch.device | str = "cpu",
                 timeout_s: float | None = 600.0, prepack_for_cpu: bool = False) -> None:
        """`model`: built on the ``meta`` device. `timeout_s`: how long one `ensure` may wait for its
        layer (None: forever). `prepack_for_cpu`: pre-pack each layer's linears for oneDNN as it is
        assigned (fp32 on CPU only, see `kernels.cpu_linear`)."""
        if not isinstance(source, LayerReadiness):
            raise ValueError(f"source must implement loader.LayerReadiness (layer_ready, wait_layer, wait_all), "
                             f"got {type(source).__name__}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        self.source = source
        self.model = model
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.prepack_for_cpu = prepack_for_cpu
        self.num_layers = model.config.num_hidden_layers  # decoder layers; gate layers run -1..num_layers
        self._tied = model.config.tie_word_embeddings
        self._lock = threading.Lock()
        self._assigned = [False] * (self.num_layers + 2)  # index layer + 1; only ever turns True
        self._frontier = 0
        self._error: LayerLoadError | None = None
        self._thread: threading.Thread | None = None
        self.num_prepacked = 0
        self.completed_at: float | None = None  # time.perf_counter() when the last layer was assigned
        self._waiting_since: dict[int, float] = {}  # layer -> monotonic time `wait_for` first waited for it

    # ---- state ------------------------------------------------------------------------------

    @property
    def frontier(self) -> int:
        """How many consecutive layers from -1 are assigned: 0 (none) .. N + 2 (all)."""
        return self._frontier

    @property
    def complete(self) -> bool:
        return self._frontier == self.num_layers + 2

    @property
    def error(self) -> LayerLoadError | None:
        """Why the weights cannot become resident, once that is known; None otherwise."""
        return self._error

    def is_assigned(self, layer: int) -> bool:
        self._check_layer(layer)
        return self._assigned[layer + 1]

    # ---- assigning --------------------------------------------------------------------------

    def ensure(self, layer: int) -> None:
        """Returns once `layer` is assigned in the model, waiting for the source if need be (at most
        ``timeout_s``). Raises `LayerLoadError` if it cannot become resident."""
        if -1 <= layer <= self.num_layers and self._assigned[layer + 1]:
            return  # the fast path: one comparison and one list lookup
        self._wait(layer, None)

    def wait_for(self, layer: int, wait_s: float) -> bool:
        """`ensure`, but gives up after `wait_s`: True once `layer` is assigned, False if it has not
        arrived yet -- so a caller blocked at the frontier can do other work (an engine serves its
        pending calls, e.g. a hand-over of the very prefill that waits) and ask again. The gate's
        ``timeout_s`` still counts from the first time this layer was waited for: a stalled
        source fails as it would with `ensure`. Raises `LayerLoadError` like `ensure`."""
        return self._wait(layer, wait_s)

    def _wait(self, layer: int, wait_s: float | None) -> bool:
        """Both waits: `wait_s` None waits up to the gate's whole ``timeout_s``; otherwise one slice."""
        if -1 <= layer <= self.num_layers and self._assigned[layer + 1]:
            return True
        self._check_layer(layer)
        if layer == self.num_layers and self._tied and not self._wait(-1, wait_s):
            return False  # the head is the embedding
        if self._error is None:
            if wait_s is None:
                timeout_s, final = self.timeout_s, True
            else:
                started = self._waiting_since.setdefault(layer, time.monotonic())
                left_s = None if self.timeout_s is None else self.timeout_s - (time.monotonic() - started)
                final = left_s is not None and left_s <= wait_s  # this slice ends at the gate's own deadline
                timeout_s = max(0.0, left_s) if final else wait_s
            try:
                tensors = self.source.wait_layer(layer, timeout_s=timeout_s)
            except TimeoutError as exc:
                if not final:
                    return False
                with self._lock:
                    self._fail_locked(layer, exc)
            except Exception as exc:  # noqa: BLE001 - any source failure (I/O, peer, checksum, timeout) is fatal here
                with self._lock:
                    self._fail_locked(layer, exc)
            else:
                with self._lock:
                    self._assign_locked(layer, tensors)
        if self._assigned[layer + 1]:  # assigned here, or by another thread while the source failed for us
            return True
        # A fresh exception per raise: threads raising one shared object would rewrite its traceback.
        raise LayerLoadError(str(self._error)) from self._error.__cause__

    def assign_ready(self) -> int:
        """Assigns every layer past the frontier whose bytes are in, without waiting for the source or
        for another thread's assignment; returns how many it assigned."""
        if not self._lock.acquire(blocking=False):
            return 0  # someone is assigning right now
        num_assigned = 0
        try:
            while not self.complete and self._error is None:
                layer = self._frontier - 1
                if self._assigned[layer + 1]:  # assigned out of order earlier; the frontier catches up
                    self._advance_frontier()
                    continue
                if not self.source.layer_ready(layer):
                    break
                try:
                    tensors = self.source.wait_layer(layer, timeout_s=self.timeout_s)
                except Exception as exc:  # noqa: BLE001 - see ensure; the next ensure of a missing layer raises it
                    self._fail_locked(layer, exc)
                    break
                self._assign_locked(layer, tensors)
                if not self._assigned[layer + 1]:
                    break  # it failed; kept in self._error
                num_assigned += 1
        finally:
            self._lock.release()
        return num_assigned

    def start_background(self) -> threading.Thread:
        """Starts a daemon thread that assigns each layer, in order, as soon as it lands, and ends when
        all are in or the source fails (the failure is kept in `error`). Returns the thread."""
        if self._thread is not None:
            raise RuntimeError("the background assigner is already started")
        self._thread = threading.Thread(target=self._assign_all, name="thaw-layer-gate", daemon=True)
        self._thread.start()
        return self._thread

    def _assign_all(self) -> None:
        try:
            for layer in range(-1, self.num_layers + 1):
                self.ensure(layer)
        except LayerLoadError:
            pass  # kept in self._error; whoever computes next raises it

    def _assign_locked(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        if self._assigned[layer + 1] or self._error is not None:
            return  # another thread won the race, or the source is known to be broken
        try:
            state = layer_state_dict(layer, tensors, self.model.config)
            # Outside inference mode: the parameters outlive the step that may have called us.
            with torch.inference_mode(False), torch.no_grad():
                for prefix in self._module_names(layer):
                    sub = {name[len(prefix) + 1:]: t.to(self.device) for name, t in state.items()
                           if name.startswith(prefix + ".")}
                    module = self.model.get_submodule(prefix)
                    module.load_state_dict(sub, assign=True, strict=True)
                    module.requires_grad_(False)
                if self.prepack_for_cpu:
                    self.num_prepacked += self.model.prepack_layer_for_cpu(layer)
        except Exception as exc:  # noqa: BLE001 - a foreign tensor or a failed copy is as fatal as a lost one
            self._fail_locked(layer, exc)
            return
        self._assigned[layer + 1] = True
        self._advance_frontier()

    def _advance_frontier(self) -> None:
        while self._frontier < len(self._assigned) and self._assigned[self._frontier]:
            self._frontier += 1
        if self.complete and self.completed_at is None:
            self.completed_at = time.perf_counter()

    def _module_names(self, layer: int) -> list[str]:
        if layer == -1:
            return ["embed_tokens"]
        if layer < self.num_layers:
            return [f"layers.{layer}"]
        return ["norm"] if self._tied else ["norm", "lm_head"]

    def _fail_locked(self, layer: int, exc: BaseException) -> None:
        """Keeps the first failure (later ones are its consequences)."""
        if self._error is None:
            self._error = LayerLoadError(f"{self.describe(layer)} could not be made resident: "
                                         f"{type(exc).__name__}: {exc}")
            self._error.__cause__ = exc

    def describe(self, layer: int) -> str:
        """How errors name a layer: ``layer 3``, ``layer -1 (embedding)``, ``layer 4 (final norm and head)``."""
        if layer == -1:
            return "layer -1 (embedding)"
        if layer == self.num_layers:
            return f"layer {layer} (final norm and head)"
        return f"layer {layer}"

    def _check_layer(self, layer: int) -> None:
        if not (isinstance(layer, int) and -1 <= layer <= self.num_layers):
            raise ValueError(f"layer {layer!r} does not exist: layers run from -1 (embedding) to "
                             f"{self.num_layers} (final norm and head)")
