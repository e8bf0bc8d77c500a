"""Who may call the platform, over real HTTP: the admin key (made once, stored hashed, reset, or
imported from a mounted secret), where the CLI finds the URL and the key, the admin routes'
refusal of any other key, and tenants with their API keys and quotas, through `AdminClient` and
the ``thaw tenants`` / ``thaw keys`` commands (`admin_api_server` serves the API).
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator

import openai
import pytest

from controller import TenantQuota, open_state_store
from infra.admin_client import AdminApiError, resolve_endpoint
from infra.admin_key import ADMIN_TENANT, ensure_admin_key, read_key_file, reset_admin_key
from tests.infra.admin_api_server import Server, serve_admin_api, spec


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serve_admin_api(tmp_path_factory.mktemp("admin-state")) as running:
        yield running


def test_the_admin_key_is_made_once_stored_hashed_and_can_be_reset(tmp_path):
    with open_state_store(str(tmp_path) + "/") as store:
        key = ensure_admin_key(store, tmp_path / "admin_key")
        assert key.startswith("thaw_") and ensure_admin_key(store, tmp_path / "admin_key") is None
        assert read_key_file(tmp_path / "admin_key") == key
        assert stat.S_IMODE((tmp_path / "admin_key").stat().st_mode) == 0o600
        records = store.list_api_keys(ADMIN_TENANT)
        assert len(records) == 1 and key.split("_", 2)[2] not in repr(records[0].to_dict())  # only a hash is kept
        assert store.verify_api_key(key) == ADMIN_TENANT
        new = reset_admin_key(store, tmp_path / "admin_key")
        assert new != key and store.verify_api_key(key) is None and store.verify_api_key(new) == ADMIN_TENANT
        assert read_key_file(tmp_path / "admin_key") == new


def test_an_admin_key_kept_elsewhere_is_imported_on_every_start_and_copied_for_the_cli(tmp_path):
    from controller import new_api_key
    from infra.admin_key import import_admin_key

    secret_file = tmp_path / "secret" / "admin-key"  # a mounted Kubernetes Secret, say
    secret_file.parent.mkdir()
    key = new_api_key()
    secret_file.write_text(key + "\n")
    with open_state_store(str(tmp_path) + "/") as store:
        assert import_admin_key(store, secret_file, tmp_path / "state" / "admin_key") is True
        assert store.verify_api_key(key) == ADMIN_TENANT and read_key_file(tmp_path / "state" / "admin_key") == key
        assert ensure_admin_key(store, tmp_path / "state" / "admin_key") is None  # the platform has its admin key
        (tmp_path / "state" / "admin_key").unlink()  # a new pod: the state directory is empty again
        assert import_admin_key(store, secret_file, tmp_path / "state" / "admin_key") is False
        assert read_key_file(tmp_path / "state" / "admin_key") == key
        tenant_key = (store.add_tenant("acme"), store.create_api_key("acme"))[1]
        secret_file.write_text(tenant_key)
        with pytest.raises(ValueError, match=f"{secret_file}: the key's id .* is taken"):
            import_admin_key(store, secret_file, None)
        secret_file.write_text("")
        with pytest.raises(ValueError, match="is empty or missing: put an admin key in it"):
            import_admin_key(store, secret_file, None)


def test_endpoint_resolution_order(tmp_path):
    (tmp_path / "gateway_url").write_text("http://10.0.0.1:9000\n")
    (tmp_path / "admin_key").write_text("from-file\n")
    assert resolve_endpoint(None, None, tmp_path, {}) == ("http://10.0.0.1:9000", "from-file")
    env = {"THAW_URL": "http://env:1/", "THAW_ADMIN_KEY": "from-env"}
    assert resolve_endpoint(None, None, tmp_path, env) == ("http://env:1", "from-env")
    assert resolve_endpoint("http://flag:2", "from-flag", tmp_path, env) == ("http://flag:2", "from-flag")
    assert resolve_endpoint(None, None, tmp_path / "none", {}) == ("http://127.0.0.1:8000", None)


def test_admin_routes_need_the_admin_key(server):
    for key, status in ((None, 401), ("thaw_0123456789abcdef_" + "x" * 43, 401)):
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.list_models(), key=key)
        assert info.value.status == status
    server.store.add_tenant("outsider")
    tenant_key = server.store.create_api_key("outsider")
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.status(), key=tenant_key)
    assert info.value.status == 403 and "admin key" in info.value.message
    assert server.call(lambda c: c.status())["routing_version"] == 3


def test_tenants_and_keys(server):
    assert server.call(lambda c: c.create_tenant("beta")) == {"tenant": "beta", "created": True}
    assert server.call(lambda c: c.create_tenant("beta"))["created"] is False
    names = [t["tenant"] for t in server.call(lambda c: c.list_tenants())]
    assert ADMIN_TENANT not in names and "beta" in names
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.create_tenant(ADMIN_TENANT))
    assert info.value.status == 400
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.create_tenant("Not Valid"))
    assert info.value.status == 400 and info.value.param == "name" and "lowercase" in info.value.message
    created = server.call(lambda c: c.create_key("beta"))
    key = created["api_key"]
    assert server.store.verify_api_key(key) == "beta" and created["key_id"] in key
    listed = server.call(lambda c: c.list_keys("beta"))
    assert [k["key_id"] for k in listed] == [created["key_id"]] and "api_key" not in listed[0]
    assert all(k["tenant"] != ADMIN_TENANT for k in server.call(lambda c: c.list_keys()))
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.create_key("nobody"))
    assert info.value.status == 404
    # A tenant key sees and calls only its tenant's models; the admin key sees all.
    server.call(lambda c: c.deploy(spec("beta/one")))
    server.call(lambda c: c.deploy(spec("gamma/two")))
    tenant_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    assert [m.id for m in tenant_client.models.list()] == ["beta/one"]
    with pytest.raises(openai.PermissionDeniedError):
        tenant_client.models.retrieve("gamma/two")
    admin_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.admin_key, max_retries=0)
    assert {m.id for m in admin_client.models.list()} >= {"beta/one", "gamma/two"}
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.delete_tenant("beta"))
    assert info.value.status == 409 and "beta/one" in info.value.message
    server.call(lambda c: c.delete("beta/one"))
    server.call(lambda c: c.revoke_key(created["key_id"]))
    assert server.store.verify_api_key(key) is None
    with pytest.raises(openai.AuthenticationError):
        tenant_client.models.list()
    assert server.call(lambda c: c.delete_tenant("beta")) == {"deleted": "beta"}
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.delete_tenant("beta"))
    assert info.value.status == 404
    admin_id = server.store.list_api_keys(ADMIN_TENANT)[0].key_id
    with pytest.raises(AdminApiError) as info:  # the admin key cannot be revoked through the API
        server.call(lambda c: c.revoke_key(admin_id))
    assert info.value.status == 404


def test_tenant_quotas_are_set_listed_validated_and_go_with_their_tenant(server):
    server.call(lambda c: c.create_tenant("quota-co"))
    server.call(lambda c: c.create_tenant("free-co"))
    assert server.call(lambda c: c.set_tenant_quota("quota-co", {"max_instances": 2, "max_queued_requests": 50})) == {
        "tenant": "quota-co", "max_instances": 2, "max_queued_requests": 50}
    listed = {t["tenant"]: t for t in server.call(lambda c: c.list_tenants())}
    assert listed["quota-co"] == {"tenant": "quota-co", "max_instances": 2, "max_queued_requests": 50}
    assert listed["free-co"] == {"tenant": "free-co", "max_instances": None, "max_queued_requests": None}
    # A field not named is kept; null lifts one.
    assert server.call(lambda c: c.set_tenant_quota("quota-co", {"max_queued_requests": None})) == {
        "tenant": "quota-co", "max_instances": 2, "max_queued_requests": None}
    assert server.store.get_tenant_quota("quota-co") == TenantQuota(max_instances=2)

    for body, param, message in (
            ({"max_instances": 0}, "max_instances",
             "invalid quota: max_instances: must be an integer >= 1, or null for no limit; got 0"),
            ({"max_queued_requests": "50"}, "max_queued_requests",
             "invalid quota: max_queued_requests: must be an integer >= 1, or null for no limit; got '50'"),
            ({"max_instance": 2}, "max_instance",
             "invalid quota: max_instance: unknown quota field; the fields are max_instances, max_queued_requests"),
            ({}, "max_instances", "give max_instances and/or max_queued_requests (null: no limit)")):
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.set_tenant_quota("quota-co", body))
        assert (info.value.status, info.value.param, info.value.message) == (400, param, message), body
    with pytest.raises(AdminApiError) as info:  # not an object at all
        server.call(lambda c: c._request("PUT", "/admin/tenants/quota-co/quota", [2]))
    assert info.value.status == 400
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.set_tenant_quota("nobody", {"max_instances": 1}))
    assert (info.value.status, info.value.message) == (
        404, "tenant 'nobody' does not exist; create it first (thaw tenants create nobody)")
    for tenant, param in ((ADMIN_TENANT, "tenant"), ("Quota-Co", "tenant")):
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.set_tenant_quota(tenant, {"max_instances": 1}))
        assert (info.value.status, info.value.param) == (400, param)
    assert server.store.get_tenant_quota("quota-co") == TenantQuota(max_instances=2)  # refusals changed nothing

    # Deleting the tenant drops its quota from the controller and the store: made again, it has none.
    assert server.call(lambda c: c.delete_tenant("quota-co")) == {"deleted": "quota-co"}
    assert "quota-co" not in server.controller.quotas and server.store.list_tenant_quotas() == {}
    server.call(lambda c: c.create_tenant("quota-co"))
    assert {t["tenant"]: t for t in server.call(lambda c: c.list_tenants())}["quota-co"]["max_instances"] is None


def test_cli_tenant_quota_and_listing(server):
    assert server.thaw("tenants", "create", "cliquota").returncode == 0
    result = server.thaw("tenants", "quota", "cliquota", "--max-instances", "2", "--max-queued-requests", "50")
    assert (result.returncode, result.stdout) == (0, "tenant cliquota: max_instances=2 max_queued_requests=50\n")
    result = server.thaw("tenants", "ls")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split("  ")[0] == "TENANT" and "MAX INSTANCES" in lines[0] and "MAX QUEUED REQUESTS" in lines[0]
    assert ["cliquota", "2", "50"] in [line.split() for line in lines]
    result = server.thaw("tenants", "quota", "cliquota", "--max-instances", "none")
    assert (result.returncode, result.stdout) == (
        0, "tenant cliquota: max_instances=unlimited max_queued_requests=50\n")
    assert server.store.get_tenant_quota("cliquota") == TenantQuota(max_queued_requests=50)
    result = server.thaw("tenants", "quota", "cliquota", "--max-queued-requests", "0")  # the server refuses it
    assert result.returncode == 2 and "max_queued_requests: must be an integer >= 1" in result.stderr
    result = server.thaw("tenants", "quota", "cliquota")  # nothing to set: refused before any call
    assert result.returncode == 2 and "--max-instances and/or --max-queued-requests" in result.stderr
    result = server.thaw("tenants", "quota", "cliquota", "--max-instances", "two")
    assert result.returncode == 2 and "expected an integer or 'none'" in result.stderr
    result = server.thaw("tenants", "quota", "nobody-here", "--max-instances", "1")
    assert result.returncode == 1 and "does not exist" in result.stderr
    result = server.thaw("tenants", "ls", "--json")
    assert {"tenant": "cliquota", "max_instances": None, "max_queued_requests": 50} in json.loads(result.stdout)
