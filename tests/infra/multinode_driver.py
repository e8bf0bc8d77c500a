"""Ray-level steps of the multi-node tests, run as a separate driver process.

The test process itself never joins the cluster (joining would tie its Ray state, and the
cluster's auth token, to the rest of the suite); where a test needs Ray itself it runs this
script with the cluster's environment, and reads one JSON object from its stdout:

    python -m tests.infra.multinode_driver move-controller ADDRESS NAMESPACE TO_RAY_NODE_ID [RESOURCE]
        Ends the platform's controller actor and starts its successor, with the same
        configuration (`ControllerActor.config`), pinned to another Ray node: what an operator
        does to move the controller off a node. Prints the old and new controller's nodes.
    python -m tests.infra.multinode_driver actors ADDRESS NAMESPACE
        The names of the platform's live named actors (controller, node stores, workers).
"""

from __future__ import annotations

import json
import sys
import time

import ray


def _connect(address: str, namespace: str) -> None:
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR")


def move_controller(namespace: str, to_node_id: str, resource: str | None) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from controller import DEFAULT_CONTROLLER_NAME, get_controller, start_controller
    from infra.platform_config import SERVICES_RESOURCE_AMOUNT

    old = get_controller(DEFAULT_CONTROLLER_NAME, namespace=namespace)
    old_node = ray.get(old.status.remote(), timeout=60)["controller"]["ray_node_id"]
    config = ray.get(old.config.remote(), timeout=60)
    ray.kill(old, no_restart=True)
    deadline = time.monotonic() + 60
    while True:  # the name is free once Ray has the old actor dead
        try:
            get_controller(DEFAULT_CONTROLLER_NAME, namespace=namespace)
        except ValueError:
            break
        assert time.monotonic() < deadline, "the old controller's name was not freed in 60 s"
        time.sleep(0.1)
    options = {"resources": {resource: SERVICES_RESOURCE_AMOUNT}} if resource else {}
    new = start_controller(config, name=DEFAULT_CONTROLLER_NAME,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=to_node_id, soft=False),
                           **options)
    ray.get(new.ping.remote(), timeout=120)  # answers once it has adopted the running workers
    new_node = ray.get(new.status.remote(), timeout=60)["controller"]["ray_node_id"]
    return {"old_ray_node_id": old_node, "new_ray_node_id": new_node}


def named_actors(namespace: str) -> dict:
    entries = ray.util.list_named_actors(all_namespaces=True)
    return {"actors": sorted(e["name"] for e in entries if e["namespace"] == namespace)}


def main(argv: list[str]) -> int:
    command, address, namespace, *rest = argv
    _connect(address, namespace)
    try:
        if command == "move-controller":
            result = move_controller(namespace, rest[0], rest[1] if len(rest) > 1 else None)
        elif command == "actors":
            result = named_actors(namespace)
        else:
            raise SystemExit(f"unknown command {command!r}")
    finally:
        ray.shutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
