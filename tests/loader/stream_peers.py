"""Process entry points for the layer-stream tests: a source and a receiver, each in its own process.

Started with the multiprocessing "spawn" context (a fresh interpreter, like a real worker), so
they live in an importable module rather than in the test file. Each reports on a pipe of its own:
the source sends ("rendezvous", rendezvous), ("sent", layer) after each layer and
("source_done", stats) or ("source_error", text); a receiver sends ("layer", rank, layer) when
one lands and ("received", rank, digests, stats) or ("receiver_error", rank, text) at the end.
Tensors never cross a pipe: the test rebuilds the same tensors from the seed and compares sha256
digests of their bytes, which is as strict as comparing the bytes. A held process waits on a
release pipe of its own. Nothing is shared between processes (no multiprocessing.Queue or Event):
a test kills processes, and one killed while holding a shared queue's or event's lock would hang
every other process that touches it.
"""

from __future__ import annotations

import hashlib

import torch

from loader import LayerStreamReceiver, LayerStreamSource, StreamConfig, StreamRendezvous
from tests.loader.hf_checkpoint_builder import llama_tensors

NUM_LAYERS = 3
RELEASE_WAIT_S = 60  # a guard: a held source gives up after this even if the test never releases it


def model_tensors(dtype: torch.dtype, seed: int = 0, *, big_rows: int = 97) -> dict[str, torch.Tensor]:
    """A tiny Llama plus tensors of odd sizes: a 0-dim scalar, an empty tensor, int32 ids, a
    tensor whose byte count is not a multiple of anything, and a larger one spanning many chunks."""
    tensors = llama_tensors(NUM_LAYERS, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors["model.layers.0.self_attn.odd"] = torch.randn(7, 13, generator=gen).to(dtype)
    tensors["model.layers.1.self_attn.scale"] = torch.tensor(0.125, dtype=dtype)
    tensors["model.layers.1.mlp.big"] = torch.randn(big_rows, 211, generator=gen).to(dtype)
    tensors["model.layers.2.mlp.empty"] = torch.empty(0, 5, dtype=dtype)
    tensors["model.layers.2.mlp.g_idx"] = torch.arange(1001, dtype=torch.int32)
    return tensors


def tensor_digest(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def run_source(events, release, num_receivers: int, config: StreamConfig, dtype: torch.dtype, big_rows: int,
               hold_after_layer: int | None) -> None:
    """Stream model_tensors(dtype) to `num_receivers`; after layer `hold_after_layer` has been sent,
    hold the stream until something arrives on the `release` pipe."""
    def on_layer_sent(layer: int) -> None:
        events.send(("sent", layer))
        if layer == hold_after_layer:
            release.poll(RELEASE_WAIT_S)

    source = LayerStreamSource(model_tensors(dtype, big_rows=big_rows), num_receivers, config,
                               on_layer_sent=on_layer_sent)
    events.send(("rendezvous", source.rendezvous))
    try:
        stats = source.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        events.send(("source_error", f"{type(exc).__name__}: {exc}"))
        return
    finally:
        source.close()
    events.send(("source_done", stats))


def run_receiver(events, release, rendezvous: StreamRendezvous, rank: int, config: StreamConfig,
                 hold_after_layer: int | None) -> None:
    """Receive as `rank`; report each layer as it lands and the digests at the end. With
    `hold_after_layer`, stop after that layer and wait on the `release` pipe (so the test can kill us)."""
    receiver = LayerStreamReceiver(rendezvous, rank, config)
    try:
        receiver.start()
        plan = receiver.wait_plan(RELEASE_WAIT_S)
        for layer in plan.layers:
            receiver.wait_layer(layer, RELEASE_WAIT_S)
            events.send(("layer", rank, layer))
            if layer == hold_after_layer:
                release.poll(RELEASE_WAIT_S)
        tensors = receiver.wait_all(RELEASE_WAIT_S)
        digests = {name: tensor_digest(t) for name, t in tensors.items()}
        del tensors
        stats = receiver.wait_forwarded(RELEASE_WAIT_S)
        events.send(("received", rank, digests, stats))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        events.send(("receiver_error", rank, f"{type(exc).__name__}: {exc}"))
    finally:
        receiver.close()


def run_checkpoint_source(events, release, ckpt_dir: str, config: StreamConfig, hold_after_layer: int) -> None:
    """Stream a thaw checkpoint's tensors (a running instance's weights) to one receiver, holding
    after layer `hold_after_layer` until released (or killed: what the fallback tests do)."""
    from loader import load_checkpoint

    tensors, _ = load_checkpoint(ckpt_dir)

    def on_layer_sent(layer: int) -> None:
        events.send(("sent", layer))
        if layer == hold_after_layer:
            release.poll(RELEASE_WAIT_S)

    source = LayerStreamSource(tensors, 1, config, on_layer_sent=on_layer_sent)
    events.send(("rendezvous", source.rendezvous))
    try:
        source.wait()
    finally:
        source.close()
