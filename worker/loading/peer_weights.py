"""A running instance's weights for a new instance: the source's streams and the receiver's side.

Scale-out by streaming (BlitzScale): a new instance of a model that already runs somewhere takes
its weights from that instance, layer by layer, and serves before the last layer is in
(`worker.loading.layer_gate`). `loader` moves the bytes (`LayerStreamSource` / `LayerStreamReceiver`);
this file is what a worker adds around them:

- `WeightStreams` (the source instance): opens a stream over the checkpoint the instance was loaded
  from and hands back a `PeerWeights` ticket. On a CPU node the engine's own parameters are no
  longer the checkpoint's bytes (fp32 copies pre-packed for oneDNN), so the source sends its
  node's copy of the checkpoint: on the DRAM tier those tensors are the tier's pages, mapped and
  not copied (`loader.memory_backed`), which is the memory the instance already holds. Each stream
  runs on a thread of its own and closes itself when its receivers have every byte.
- `PeerWeights`: the ticket, which travels through the controller: the stream's rendezvous, the
  receiver's rank in the chain, and the model's small files (config, tokenizer), which the new
  instance needs before any weight arrives and which its node may not hold yet.
- `PeerWeightsReceiver` (the new instance): writes those files to a private directory (the
  engine's model dir), receives the stream, and falls back to the node's own copy of the
  checkpoint when the peer dies (`loader.FallbackLayers`). That copy may still be on its way when
  the instance starts (the controller fetches it while the stream runs), so the fallback waits
  for `supply_fallback(path)` -- an explicit hand-over, not a poll -- up to `fallback_timeout_s`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from loader import (FallbackLayers, LayerReadiness, LayerStreamReceiver, LayerStreamSource, StreamConfig,
                    StreamRendezvous, StreamStats, ThawCheckpointLoader, ThawIndex, is_thaw_checkpoint)
from worker.loading.checkpoint import read_checkpoint

logger = logging.getLogger(__name__)

MAX_MODEL_FILES_BYTES = 64 << 20  # config + tokenizer; anything near this is not a small file
_WEIGHT_SUFFIXES = (".bin", ".safetensors", ".pt", ".pth")


@dataclass(frozen=True)
class PeerWeights:
    """What a new instance needs to take its weights from a running one (crosses Ray as a pickle).

    `model_files`: (name, bytes) of the model's files other than its weights -- what the engine
    reads before any layer arrives. `rank`: this receiver's place in the chain (1..num_receivers);
    `for_rank` gives each receiver of a chain multicast its own ticket."""

    source_instance_id: str
    model_id: str
    rendezvous: StreamRendezvous
    stream_config: StreamConfig
    total_bytes: int
    model_files: tuple[tuple[str, bytes], ...] = field(repr=False)
    rank: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= self.rendezvous.num_receivers:
            raise ValueError(f"PeerWeights.rank is {self.rank!r}; the stream has receivers 1.."
                             f"{self.rendezvous.num_receivers}")
        for name, _ in self.model_files:
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise ValueError(f"PeerWeights.model_files names {name!r}, which is not a plain file name")

    def for_rank(self, rank: int) -> PeerWeights:
        return PeerWeights(self.source_instance_id, self.model_id, self.rendezvous, self.stream_config,
                           self.total_bytes, self.model_files, rank)


def model_files(checkpoint_dir: str | Path) -> tuple[tuple[str, bytes], ...]:
    """The checkpoint dir's plain files that are not weights: config, tokenizer, generation config
    (and a thaw checkpoint's index, which the receiver does not need but costs nothing); hidden
    files, e.g. the loader's verification record, are the source's own."""
    checkpoint_dir = Path(checkpoint_dir)
    weights: set[str] = set()
    if is_thaw_checkpoint(checkpoint_dir):
        weights = {p.file for p in ThawIndex.read(checkpoint_dir).partitions}
    files, total = [], 0
    for path in sorted(checkpoint_dir.iterdir()):
        if not path.is_file() or path.name in weights or path.name.endswith(_WEIGHT_SUFFIXES) or path.name.startswith("."):
            continue
        data = path.read_bytes()
        total += len(data)
        if total > MAX_MODEL_FILES_BYTES:
            raise ValueError(f"{checkpoint_dir}: the files beside the weights exceed {MAX_MODEL_FILES_BYTES >> 20} MiB "
                             f"(at {path.name}); a new instance cannot be sent them with the stream")
        files.append((path.name, data))
    return tuple(files)


class WeightStreams:
    """The weight streams a running instance serves (see the module docstring)."""

    def __init__(self, instance_id: str, model_id: str) -> None:
        self.instance_id = instance_id
        self.model_id = model_id
        self._lock = threading.Lock()
        self._active: set[LayerStreamSource] = set()
        self._closed = False
        self.num_served = 0  # streams that delivered every byte to their first receiver
        self.num_failed = 0

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def open(self, checkpoint_dir: str | Path, num_receivers: int, config: StreamConfig) -> PeerWeights:
        """Start streaming the checkpoint at `checkpoint_dir` to `num_receivers` chained receivers;
        returns the ticket for rank 1 (`for_rank` for the others). Blocks while the checkpoint is
        opened (mapped from the DRAM tier, else read): call it off the event loop."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"instance {self.instance_id} is shutting down; it streams no weights")
        files = model_files(checkpoint_dir)
        tensors, how = read_checkpoint(checkpoint_dir)
        source = LayerStreamSource(tensors, num_receivers, config)
        del tensors  # the source keeps what it sends
        ticket = PeerWeights(self.instance_id, self.model_id, source.rendezvous, config, source.plan.total_bytes,
                             files)
        with self._lock:
            if self._closed:
                source.close()
                raise RuntimeError(f"instance {self.instance_id} is shutting down; it streams no weights")
            self._active.add(source)
        logger.info("instance %s: streaming %s (%.2f GB; %s) to %d receiver(s) as %s", self.instance_id,
                    self.model_id, source.plan.total_bytes / 1e9, how, num_receivers, source.rendezvous.transfer_id)
        source.start()
        threading.Thread(target=self._finish, args=(source,), name=f"thaw-weights-{self.instance_id}",
                         daemon=True).start()
        return ticket

    def _finish(self, source: LayerStreamSource) -> None:
        try:
            stats = source.wait()
            self.num_served += 1
            logger.info("instance %s: stream %s done: %.2f GB in %.2f s (%.2f GB/s)", self.instance_id,
                        source.rendezvous.transfer_id, stats.num_bytes / 1e9, stats.elapsed_s, stats.gb_per_s)
        except Exception as exc:  # noqa: BLE001 - the receiver sees it too and falls back
            self.num_failed += 1
            logger.warning("instance %s: stream %s failed: %s", self.instance_id, source.rendezvous.transfer_id, exc)
        finally:
            source.close()
            with self._lock:
                self._active.discard(source)

    def close(self) -> None:
        """Stop every stream still running (its receivers fall back to their tier)."""
        with self._lock:
            self._closed = True
            active = list(self._active)
        for source in active:
            source.close()


class PeerWeightsReceiver:
    """The new instance's side of a stream (see the module docstring); `layers` is what the engine takes."""

    def __init__(self, peer: PeerWeights, *, fallback_timeout_s: float) -> None:
        if not fallback_timeout_s > 0:
            raise ValueError(f"fallback_timeout_s must be > 0, got {fallback_timeout_s!r}")
        self.peer = peer
        self.fallback_timeout_s = fallback_timeout_s
        self.model_dir = Path(tempfile.mkdtemp(prefix="thaw-peer-"))
        try:
            for name, data in peer.model_files:
                (self.model_dir / name).write_bytes(data)
            self._receiver = LayerStreamReceiver(peer.rendezvous, peer.rank, peer.stream_config)
        except BaseException:
            shutil.rmtree(self.model_dir, ignore_errors=True)
            raise
        self._fallback_dir: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.fallback_loader: ThawCheckpointLoader | None = None
        self.layers: LayerReadiness = FallbackLayers(
            self._receiver, self._open_fallback,
            describe_primary=f"the stream from instance {peer.source_instance_id}")

    def start(self) -> None:
        self._receiver.start()

    @property
    def switched(self) -> bool:
        """Whether the stream failed and the layers now come from the node's copy."""
        return self.layers.switched

    @property
    def fallback_reason(self) -> str | None:
        return self.layers.reason

    @property
    def fallback_dir(self) -> str | None:
        """The node's own copy of the checkpoint, once supplied."""
        return self._fallback_dir.result() if self._fallback_dir.done() else None

    def supply_fallback(self, checkpoint_dir: str) -> None:
        """The node's copy of the checkpoint is in place (read only if the stream fails). Once only."""
        if self._fallback_dir.done():
            raise RuntimeError(f"the fallback checkpoint was already supplied ({self._fallback_dir.result()})")
        if not is_thaw_checkpoint(checkpoint_dir):
            raise ValueError(f"{checkpoint_dir} is not a thaw checkpoint (no thaw_index.json): it cannot serve "
                             "as the fallback of a stream")
        self._fallback_dir.set_result(str(checkpoint_dir))

    def _open_fallback(self) -> LayerReadiness:
        try:
            path = self._fallback_dir.result(timeout=self.fallback_timeout_s)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"the stream from instance {self.peer.source_instance_id} failed and the node's own "
                               f"copy of {self.peer.model_id} did not arrive within {self.fallback_timeout_s:g} s"
                               ) from None
        loader = ThawCheckpointLoader(path)
        loader.start()
        self.fallback_loader = loader  # its buffer lives as long as the engine's views of it
        return loader

    @property
    def stats(self) -> StreamStats:
        return self._receiver.stats

    def describe(self) -> str:
        """Where the layers came from, in one line (for the instance's load report)."""
        stats = self.stats
        if self.switched:
            return (f"{self.fallback_reason}; the rest read from the node's copy "
                    f"({stats.num_bytes / 1e9:.3g} GB had arrived by stream)")
        done = "" if stats.num_bytes < stats.total_bytes or not stats.total_bytes else \
            f" in {stats.elapsed_s:.2f} s ({stats.gb_per_s:.2f} GB/s)"
        return (f"streamed from instance {self.peer.source_instance_id}: "
                f"{stats.num_bytes / 1e9:.3g} of {stats.total_bytes / 1e9:.3g} GB{done}")

    def close(self) -> None:
        """Stop receiving (after forwarding a complete stream down the chain) and drop the model files.
        The layers handed out stay valid: the engine holds them."""
        self._receiver.close()
        shutil.rmtree(self.model_dir, ignore_errors=True)
