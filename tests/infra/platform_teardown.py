"""Ending a test's real platform: stop its controller (and workers), then end any actor of its
namespace that survived, returning their names so the test can assert none did."""

from __future__ import annotations

import ray

from controller import stop_controller


def stop_platform(controller, namespace: str) -> list[str]:
    stop_controller(controller, stop_workers=True)
    leftovers = [e["name"] for e in ray.util.list_named_actors(True) if e["namespace"] == namespace]
    for name in leftovers:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    return leftovers
