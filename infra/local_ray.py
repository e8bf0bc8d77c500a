"""A single-node Ray reachable from this machine only: `init_local_ray`.

When ``thaw serve`` starts Ray itself (no ``--address``), nothing but this machine needs to
reach Ray's servers (GCS, raylet, object manager, workers, agents): a cluster is joined with
``--address`` instead. Left to itself, Ray binds them to the machine's external address (or
all interfaces), where anyone on the network could talk to them. So the node is pinned to
``127.0.0.1``, which makes Ray bind every server there.

Ray's own switch does not do it alone: ``ray.init(_node_ip_address="127.0.0.1")`` turns a
loopback address into the machine's external one ("remotely reachable"), except where Ray
believes the platform cannot form clusters at all — a flag it reads once, at import, from
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` into ``ray._private.ray_constants.ENABLE_RAY_CLUSTER``.
`init_local_ray` lowers that flag for the duration of ``ray.init`` only (Ray is then already
bound to the address, and every later lookup reads the started node's address), and checks the
address Ray settled on afterwards; tests/infra/test_local_ray.py checks the listening sockets,
so a Ray upgrade that changes this is caught there. Ray's workers learn the address from their
raylet, so they advertise loopback too (the workers' weight and KV streams included).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def init_local_ray(**options: Any) -> str:
    """``ray.init(**options)`` starting a new single-node Ray bound to `LOOPBACK`; returns the
    node address Ray settled on (it logs a warning if that is not loopback)."""
    import ray

    if "address" in options or "_node_ip_address" in options:
        raise ValueError("init_local_ray starts a new loopback-only Ray; join a cluster with ray.init(address=...)")
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without the module: start it anyway, and say so below
        ray_constants = None
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if saved is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(_node_ip_address=LOOPBACK, **options)
    finally:
        if saved is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved
    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        logger.warning("the local Ray runs on %s, not loopback: other machines may reach its ports "
                       "(they require Ray's token where token auth is on)", address)
    return address
