"""Thaw's checkpoint format and fast loader.

`convert_checkpoint` turns a Hugging Face safetensors model dir into a thaw checkpoint (few
4096-aligned partition files in layer order, xxh3_64 per chunk, `thaw_index.json`);
`ThawCheckpointLoader` reads it on a thread pool into one pre-faulted `HostMemoryPool` buffer,
verifying each chunk, and hands out each layer as soon as its bytes are in. Nothing here imports
the worker, controller, storage or infra: the worker builds on this, not the other way round.
"""

from loader.checkpoint_loader import LoaderConfig, LoadStats, ThawCheckpointLoader, load_checkpoint
from loader.converter import convert_checkpoint
from loader.format import (FORMAT_VERSION, CheckpointFormatError, ChecksumMismatchError, ThawIndex,
                           TruncatedCheckpointError, is_thaw_checkpoint)
from loader.fallback_layers import FallbackLayers
from loader.layer_readiness import LayerReadiness
from loader.layer_stream import StreamConfig, StreamRendezvous, StreamStats
from loader.layer_stream_receiver import LayerStreamReceiver
from loader.layer_stream_source import LayerStreamSource
from loader.memory_pool import HostMemoryPool
from loader.peer_link import PeerStreamError
from loader.stream_plan import StreamPlan

__all__ = [
    "FORMAT_VERSION",
    "CheckpointFormatError",
    "ChecksumMismatchError",
    "FallbackLayers",
    "HostMemoryPool",
    "LayerReadiness",
    "LayerStreamReceiver",
    "LayerStreamSource",
    "LoadStats",
    "LoaderConfig",
    "PeerStreamError",
    "StreamConfig",
    "StreamPlan",
    "StreamRendezvous",
    "StreamStats",
    "ThawCheckpointLoader",
    "ThawIndex",
    "TruncatedCheckpointError",
    "convert_checkpoint",
    "is_thaw_checkpoint",
    "load_checkpoint",
]
