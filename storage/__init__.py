"""Model storage tiers: the repository (local directory or S3), and each node's SSD and DRAM caches.

`ModelRepository` (open one with `open_repository(RepositoryConfig(uri))`) is the source of
truth: push (a Hugging Face dir converted to the thaw format once, there, and stored beside it;
staged, made visible in one conditional manifest write: of two racing pushes exactly one wins,
`PushConflictError` for the other; its progress reported through `PushProgress`, its upload rate
capped by `UploadThrottle` when configured), list, describe, fetch with parallel ranged reads.
`NodeStore` (as a Ray actor: `start_node_store`) keeps thaw-format copies on the node's SSD and
in shared memory within byte capacities -- copying what the push converted, converting only a
model the repository holds in Hugging Face form alone --, fills a miss once however many ask, evicts least recently used (never pinned or
loading) entries, re-fetches a corrupt copy, measures the node's bandwidths and reports what it
holds (`NodeStoreReport`). Every checkpoint file it writes is the owner's only (directories 0700,
files 0600). Depends on `loader` (and `wire`'s records) only.

The node-store names are imported on first use (PEP 562 `__getattr__`): they need the loader and
so torch, seconds to import, which the repository side (``thaw models ls``, the controller reading
reports) does not.
"""

import importlib

from storage.local_repository import LocalModelRepository
from storage.model_name import InvalidModelNameError, validate_model_name
from storage.model_repository import (FetchResult, FetchVerificationError, ModelExistsError, ModelNotFoundError,
                                      ModelRepository, ObjectNotFoundError, PushConflictError, PushProgress,
                                      RepositoryError, UploadThrottle, file_xxh3_64)
from storage.repository_config import RepositoryConfig, open_repository
from storage.repository_manifest import ManifestError, ManifestFile, ModelManifest
from storage.s3_repository import S3ModelRepository
from storage.s3_source import S3Source, S3SourceError, source_client
from storage.store_config import NodeStoreConfig
from storage.store_report import BandwidthReport, NodeStoreReport, TierEntryReport, TierReport
from storage.tier_ledger import TierFullError

_LAZY = {
    "EntryMissingError": "storage.checkpoint_tier",
    "NodeStore": "storage.node_store",
    "NodeStoreActor": "storage.node_store_actor",
    "start_node_store": "storage.node_store_actor",
    "stop_node_store": "storage.node_store_actor",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")


__all__ = [
    "BandwidthReport",
    "EntryMissingError",
    "FetchResult",
    "FetchVerificationError",
    "InvalidModelNameError",
    "LocalModelRepository",
    "ManifestError",
    "ManifestFile",
    "ModelExistsError",
    "ModelManifest",
    "ModelNotFoundError",
    "ModelRepository",
    "NodeStore",
    "NodeStoreActor",
    "NodeStoreConfig",
    "NodeStoreReport",
    "ObjectNotFoundError",
    "PushConflictError",
    "PushProgress",
    "UploadThrottle",
    "file_xxh3_64",
    "RepositoryConfig",
    "RepositoryError",
    "S3ModelRepository",
    "S3Source",
    "S3SourceError",
    "TierEntryReport",
    "TierFullError",
    "TierReport",
    "open_repository",
    "source_client",
    "start_node_store",
    "stop_node_store",
    "validate_model_name",
]
