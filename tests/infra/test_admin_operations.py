"""Operating the platform through the admin API and the ``thaw`` CLI, over real HTTP: the migrate
route's checks and refusals, an unreachable controller as a 503, and the CLI's tables (status,
list, drain, migrate, ...) with its exit codes (`admin_api_server` serves the API).
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest

from infra.admin_client import AdminApiError
from tests.infra.admin_api_server import DEADLINE_S, THAW, Server, serve_admin_api


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serve_admin_api(tmp_path_factory.mktemp("admin-state")) as running:
        yield running


def test_migrate_route_validates_and_maps_refusals_to_statuses(server):
    result = server.call(lambda c: c.migrate("i-1", "r1", method="tokens"))
    assert (result.destination_id, [o.request_id for o in result.outcomes]) == ("i-2", ["r1"])
    assert server.controller.migrations[-1] == ("i-1", "r1", None, None, "tokens")
    for kwargs, status, param in ((dict(method="teleport"), 400, "method"),
                                  (dict(to_node="node1", to_instance="i-2"), 400, "to_node"),
                                  (dict(to_node=" "), 400, "to_node"),
                                  (dict(to_node="node7"), 409, None)):
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.migrate("i-1", **kwargs))
        assert (info.value.status, info.value.param) == (status, param), kwargs
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.migrate("i-9"))
    assert info.value.status == 404 and "i-9" in info.value.message
    with pytest.raises(AdminApiError) as info:  # a field the API does not know: refused, not ignored
        server.call(lambda c: c._request("POST", "/admin/migrate", {"instance_id": "i-1", "to": "node1"}))
    assert info.value.status == 400


def test_an_unreachable_controller_is_503_with_retry_after(server):
    server.controller.unavailable = True
    try:
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.status())
        assert info.value.status == 503
        request = urllib.request.Request(f"{server.url}/admin/models",
                                         headers={"Authorization": f"Bearer {server.admin_key}"})
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(request, timeout=DEADLINE_S)
        assert http.value.code == 503 and http.value.headers["Retry-After"] == "1"
    finally:
        server.controller.unavailable = False


def test_cli_commands_print_tables_and_exit_with_meaningful_codes(server, tmp_path):
    spec_file = tmp_path / "model.yaml"
    spec_file.write_text("tenant: cli\nname: small\nsource: ./weights\nautoscaling:\n  max_instances: 2\n")
    result = server.thaw("deploy", str(spec_file), "--min-instances", "1")
    assert result.returncode == 0, result.stderr
    stored = server.controller.specs["cli/small"]
    assert stored["source"] == str(tmp_path / "weights") and stored["autoscaling"]["min_instances"] == 1
    result = server.thaw("list")
    assert result.returncode == 0 and "cli/small" in result.stdout and "1..2" in result.stdout
    result = server.thaw("status")
    assert result.returncode == 0, result.stderr
    for text in ("MODELS", "acme/m", "INSTANCES", "i-1", "CHECKPOINTS", "acme--m", "dram", "ssd",
                 "LOAD ESTIMATES", "0.12", "1/2"):
        assert text in result.stdout, text
    assert server.thaw("scale", "cli/small", "--max", "3").returncode == 0
    assert server.controller.specs["cli/small"]["autoscaling"]["max_instances"] == 3
    result = server.thaw("scale", "cli/small", "--max", "0")  # the server refuses the value: bad input
    assert result.returncode == 2 and "max_instances" in result.stderr
    result = server.thaw("drain", "node0")
    assert result.returncode == 0 and "i-1" in result.stdout and server.controller.drained == ["node0"]
    assert server.thaw("drain", "node9").returncode == 1
    result = server.thaw("undrain", "node0")
    assert result.returncode == 0 and "node0 takes new instances again" in result.stdout
    assert server.controller.drained == []
    assert server.thaw("undrain", "node9").returncode == 1
    result = server.thaw("migrate", "i-1", "--to-node", "node1")
    assert result.returncode == 0, result.stderr
    assert "2/2 request(s) migrated from i-1 to i-2" in result.stdout and "r2" in result.stdout
    result = server.thaw("migrate", "i-1", "--method", "teleport")  # refused by the CLI itself
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = server.thaw("migrate", "i-1", "--to-node", "node1", "--to-instance", "i-2")
    assert result.returncode == 2 and "not allowed with" in result.stderr
    result = server.thaw("migrate", "i-1", "--to-node", "")  # refused by the server as invalid: bad input
    assert result.returncode == 2 and "to_node" in result.stderr
    result = server.thaw("migrate", "i-9")  # unknown instance: not bad input, a refusal
    assert result.returncode == 1 and "i-9" in result.stderr
    result = server.thaw("tenants", "create", "clitenant")
    assert result.returncode == 0 and "created" in result.stdout
    result = server.thaw("keys", "create", "clitenant")
    assert result.returncode == 0 and server.store.verify_api_key(result.stdout.strip()) == "clitenant"
    result = server.thaw("keys", "ls", "--tenant", "clitenant", "--json")
    assert result.returncode == 0 and '"tenant": "clitenant"' in result.stdout
    result = server.thaw("delete", "cli/small")
    assert result.returncode == 0 and "cli/small" not in server.controller.specs
    result = server.thaw("delete", "cli/small")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "not deployed" in result.stderr
    result = server.thaw("deploy", "--name", "cli/x")  # no --source: refused before any call
    assert result.returncode == 2 and "--source" in result.stderr
    result = server.thaw("status", key=None)  # the key comes from the state directory's admin_key file
    assert result.returncode == 0 and "MODELS" in result.stdout
    result = subprocess.run([THAW, "status", "--url", server.url, "--state", str(tmp_path / "empty")],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if k != "THAW_ADMIN_KEY"})
    assert result.returncode == 1 and "no admin key found" in result.stderr
    result = subprocess.run([THAW, "status", "--url", "http://127.0.0.1:9", "--admin-key", "k"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no Thaw gateway answers" in result.stderr
