"""`init_local_ray`: the Ray that ``thaw serve`` starts for itself listens on loopback only
(issue 19, item 10). Plain ``ray.init()`` binds the GCS, raylet and workers to every interface.

Real Ray, in a fresh interpreter (the loopback pinning happens at ``ray.init``, and this test
process may have started a Ray of its own): the child lists the listening sockets of itself
and of every process it started (GCS, raylet, agents, a worker that ran a task).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from infra.local_ray import init_local_ray

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LOOPBACK_IPS = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}

CHILD = textwrap.dedent("""
    import json, logging
    import psutil, ray
    from infra.local_ray import init_local_ray

    address = init_local_ray(num_cpus=1, include_dashboard=False, logging_level=logging.WARNING)

    @ray.remote
    def node_address():
        return ray.util.get_node_ip_address()

    worker_address = ray.get(node_address.remote())
    me = psutil.Process()
    listening = []
    for process in [me, *me.children(recursive=True)]:
        try:
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening.append([process.name(), conn.laddr.ip, conn.laddr.port])
        except psutil.Error:
            pass  # a process that ended meanwhile
    ray.shutdown()
    print(json.dumps({"address": address, "worker_address": worker_address, "listening": listening}))
""")


def test_the_local_ray_listens_on_loopback_only():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["address"] == "127.0.0.1" and report["worker_address"] == "127.0.0.1"
    names = {name for name, _, _ in report["listening"]}
    assert "gcs_server" in names and "raylet" in names, report["listening"]
    exposed = [entry for entry in report["listening"] if entry[1] not in LOOPBACK_IPS]
    assert exposed == [], exposed


def test_joining_a_cluster_is_not_its_job():
    with pytest.raises(ValueError, match="join a cluster with ray.init"):
        init_local_ray(address="ray://head:10001")
