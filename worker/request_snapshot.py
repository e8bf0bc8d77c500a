"""`RequestSnapshot` (a request's state without its KV) now lives in `wire/` (`wire.request_snapshot`).

The source worker's engine takes it, the migration driver carries it and the destination
worker's engine continues from it, over Ray, so it is a wire record, defined once in the
torch-free `wire` package (tagged, checked again on arrival). This module re-exports it for the
worker's own modules (`worker.engine_migration`, `worker.request_lifecycle`,
`worker.layer_handoff`) and for callers of ``worker.request_snapshot``; ``from worker import
RequestSnapshot`` works as before.
"""

from wire.request_snapshot import RequestSnapshot

__all__ = ["RequestSnapshot"]
