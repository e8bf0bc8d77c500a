"""Thaw's checkpoint format and fast loader.

`convert_checkpoint` turns a Hugging Face safetensors model dir into a thaw checkpoint (few
4096-aligned partition files in layer order, xxh3_64 per chunk, `thaw_index.json`);
`ThawCheckpointLoader` reads it on a thread pool into one pre-faulted `HostMemoryPool` buffer,
verifying each chunk, and hands out each layer as soon as its bytes are in; `DeviceLoader` does the
same straight into device memory, through a small pool of pinned staging buffers (`StagingPool`)
and asynchronous copies (`CudaCopyEngine`), or by DMA from the DRAM tier's own pages. Nothing here imports
the worker, controller, storage or infra: the worker builds on this, not the other way round.

Two small, torch-free pieces serve every reader of model directories, here and in `storage`:
`model_dir_files` / `shard_paths` / `contained_path` refuse a directory that names files outside
itself (`UnsafeModelDirError`), and `make_private_dirs` / `open_private` / `write_private` /
`copy_private` / `make_private_tree` make checkpoint files only their owner can read. They are imported eagerly;
everything else on first use (PEP 562 `__getattr__`), because it brings torch (seconds to
import), which pushing a model to the repository or checking a directory does not need.
"""

import importlib

from loader.model_dir import UnsafeModelDirError, contained_path, model_dir_files, shard_paths
from loader.private_files import (PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, copy_private, make_private_dirs,
                                  make_private_tree, open_private, write_private)

_LAZY = {
    "FORMAT_VERSION": "loader.format",
    "CheckpointFormatError": "loader.format",
    "ChecksumMismatchError": "loader.format",
    "CopyEngine": "loader.copy_engine",
    "CudaCopyEngine": "loader.copy_engine",
    "DeviceLoadStats": "loader.device_loader",
    "DeviceLoader": "loader.device_loader",
    "DeviceLoaderConfig": "loader.device_loader",
    "FallbackLayers": "loader.fallback_layers",
    "HostMemoryPool": "loader.memory_pool",
    "LayerReadiness": "loader.layer_readiness",
    "LayerStreamReceiver": "loader.layer_stream_receiver",
    "LayerStreamSource": "loader.layer_stream_source",
    "LoadStats": "loader.checkpoint_loader",
    "LoaderConfig": "loader.checkpoint_loader",
    "PeerStreamError": "loader.peer_link",
    "StagingConfig": "loader.staging_pool",
    "StagingPool": "loader.staging_pool",
    "StreamConfig": "loader.layer_stream",
    "StreamPlan": "loader.stream_plan",
    "StreamRendezvous": "loader.layer_stream",
    "StreamStats": "loader.layer_stream",
    "ThawCheckpointLoader": "loader.checkpoint_loader",
    "ThawIndex": "loader.format",
    "TruncatedCheckpointError": "loader.format",
    "convert_checkpoint": "loader.converter",
    "is_thaw_checkpoint": "loader.format",
    "load_checkpoint": "loader.checkpoint_loader",
    "load_to_device": "loader.device_loader",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loader' has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "CheckpointFormatError",
    "ChecksumMismatchError",
    "CopyEngine",
    "CudaCopyEngine",
    "DeviceLoadStats",
    "DeviceLoader",
    "DeviceLoaderConfig",
    "FallbackLayers",
    "HostMemoryPool",
    "LayerReadiness",
    "LayerStreamReceiver",
    "LayerStreamSource",
    "LoadStats",
    "LoaderConfig",
    "PeerStreamError",
    "StagingConfig",
    "StagingPool",
    "StreamConfig",
    "StreamPlan",
    "StreamRendezvous",
    "StreamStats",
    "ThawCheckpointLoader",
    "ThawIndex",
    "TruncatedCheckpointError",
    "UnsafeModelDirError",
    "contained_path",
    "convert_checkpoint",
    "copy_private",
    "is_thaw_checkpoint",
    "load_checkpoint",
    "load_to_device",
    "make_private_dirs",
    "make_private_tree",
    "model_dir_files",
    "open_private",
    "shard_paths",
    "write_private",
]
