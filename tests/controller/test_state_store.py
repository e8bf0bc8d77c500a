"""Tests for the state store: the same tests on SQLite and on a real redis-server, plus the
factory's URL handling, each backend's schema-version guard, and the warning about a Redis
server that persists nothing."""

from __future__ import annotations

import logging
import sqlite3
import threading

import pytest

from controller import (
    AutoscalingPolicy,
    ModelSpec,
    SpecError,
    StateStoreError,
    TenantQuota,
    WorkerRecord,
    open_state_store,
)
from controller.redis_state_store import RedisStateStore
from controller.sqlite_state_store import SqliteStateStore
from controller.state_store import SCHEMA_VERSION
from tests.controller.redis_server import RedisServer, _free_port, find_redis_server
from wire import InstanceState


def _spec(model_id: str, max_instances: int = 1) -> ModelSpec:
    tenant, name = model_id.split("/")
    return ModelSpec(
        tenant=tenant, name=name, source=f"s3://models/{name}",
        autoscaling=AutoscalingPolicy(max_instances=max_instances),
    )


def _worker(instance_id: str, model_id: str = "acme/llama", state: str = "ready") -> WorkerRecord:
    return WorkerRecord(
        instance_id=instance_id, model_id=model_id, node_id="node-1", actor_name=f"thaw-worker-{instance_id}",
        state=state,
    )


# --- both backends ------------------------------------------------------------------------------


def test_model_specs_put_get_list_delete(store):
    assert store.get_model_spec("acme/llama") is None
    store.put_model_spec(_spec("zeta/qwen"))
    store.put_model_spec(_spec("acme/llama"))
    store.put_model_spec(_spec("acme/gemma"))
    assert store.get_model_spec("acme/llama") == _spec("acme/llama")
    assert [s.model_id for s in store.list_model_specs()] == ["acme/gemma", "acme/llama", "zeta/qwen"]
    assert [s.model_id for s in store.list_model_specs(tenant="acme")] == ["acme/gemma", "acme/llama"]
    assert store.list_model_specs(tenant="nobody") == []

    store.put_model_spec(_spec("acme/llama", max_instances=5))  # update replaces
    assert store.get_model_spec("acme/llama").autoscaling.max_instances == 5
    assert len(store.list_model_specs()) == 3

    store.set_desired_instances("acme/llama", 2)
    assert store.delete_model_spec("acme/llama") is True
    assert store.delete_model_spec("acme/llama") is False
    assert store.get_model_spec("acme/llama") is None
    assert store.get_desired_instances("acme/llama") is None  # went with its spec
    assert [s.model_id for s in store.list_model_specs()] == ["acme/gemma", "zeta/qwen"]


def test_model_ids_are_validated_at_the_store(store):
    with pytest.raises(SpecError, match="must not contain '..'"):
        store.get_model_spec("acme/..")
    with pytest.raises(SpecError, match="must be 'tenant/model'"):
        store.set_desired_instances("no-tenant", 1)
    with pytest.raises(SpecError, match="tenant"):
        store.list_model_specs(tenant="../etc")


def test_tenants(store):
    assert store.list_tenants() == []
    assert store.add_tenant("zeta") is True
    assert store.add_tenant("acme") is True
    assert store.add_tenant("acme") is False
    assert store.list_tenants() == ["acme", "zeta"]
    assert store.delete_tenant("zeta") is True
    assert store.delete_tenant("zeta") is False
    assert store.list_tenants() == ["acme"]
    with pytest.raises(SpecError):
        store.add_tenant("Bad Tenant")


def test_api_keys_verify_revoke_and_store_only_hashes(store):
    with pytest.raises(StateStoreError, match="no tenant 'acme'"):
        store.create_api_key("acme")
    store.add_tenant("acme")
    store.add_tenant("zeta")
    key_a = store.create_api_key("acme")
    key_z = store.create_api_key("zeta")
    assert key_a != key_z and key_a.startswith("thaw_")

    assert store.verify_api_key(key_a) == "acme"
    assert store.verify_api_key(key_z) == "zeta"
    wrong_secret = key_a[:-1] + ("A" if key_a[-1] != "A" else "B")
    assert store.verify_api_key(wrong_secret) is None
    assert store.verify_api_key("thaw_0000000000000000_" + key_a.split("_", 2)[2]) is None  # unknown id
    for malformed in ("", "thaw_", "Bearer " + key_a, key_a + "x", None):
        assert store.verify_api_key(malformed) is None

    records = store.list_api_keys()
    assert sorted(r.tenant for r in records) == ["acme", "zeta"]
    assert [r.tenant for r in store.list_api_keys(tenant="acme")] == ["acme"]
    for record, key in ((r, k) for r in records for k in (key_a, key_z)):
        secret = key.split("_", 2)[2]
        assert all(secret not in str(value) for value in record.to_dict().values())

    key_id_a = key_a.split("_")[1]
    assert store.revoke_api_key(key_id_a) is True
    assert store.revoke_api_key(key_id_a) is False
    assert store.verify_api_key(key_a) is None
    assert store.verify_api_key(key_z) == "zeta"


def test_deleting_a_tenant_revokes_its_keys(store):
    store.add_tenant("acme")
    keys = [store.create_api_key("acme") for _ in range(3)]
    assert all(store.verify_api_key(key) == "acme" for key in keys)
    assert store.delete_tenant("acme") is True
    assert [store.verify_api_key(key) for key in keys] == [None, None, None]
    assert store.list_api_keys() == []


def test_tenant_quotas_set_replace_lift_and_go_with_their_tenant(store):
    assert store.get_tenant_quota("acme") == TenantQuota()  # none set: no limits
    assert store.list_tenant_quotas() == {}
    with pytest.raises(StateStoreError, match="no tenant 'acme'; add it before setting its quota"):
        store.set_tenant_quota("acme", TenantQuota(max_instances=2))
    store.add_tenant("acme")
    store.add_tenant("zeta")
    store.set_tenant_quota("zeta", TenantQuota(max_queued_requests=10))
    store.set_tenant_quota("acme", TenantQuota(max_instances=2, max_queued_requests=50))
    assert store.get_tenant_quota("acme") == TenantQuota(max_instances=2, max_queued_requests=50)
    assert list(store.list_tenant_quotas().items()) == [
        ("acme", TenantQuota(max_instances=2, max_queued_requests=50)), ("zeta", TenantQuota(max_queued_requests=10))]

    store.set_tenant_quota("acme", TenantQuota(max_instances=3))  # replaces the whole quota
    assert store.get_tenant_quota("acme") == TenantQuota(max_instances=3)
    store.set_tenant_quota("zeta", TenantQuota())  # no limits left: no record
    assert store.list_tenant_quotas() == {"acme": TenantQuota(max_instances=3)}

    assert store.delete_tenant("acme") is True
    assert store.get_tenant_quota("acme") == TenantQuota() and store.list_tenant_quotas() == {}
    store.add_tenant("acme")  # a tenant made again under the old name starts with no limits
    assert store.get_tenant_quota("acme") == TenantQuota()
    with pytest.raises(SpecError, match="tenant"):
        store.get_tenant_quota("../etc")


def test_desired_instances(store):
    assert store.get_desired_instances("acme/llama") is None
    store.set_desired_instances("acme/llama", 3)
    store.set_desired_instances("acme/gemma", 0)
    store.set_desired_instances("acme/llama", 1)
    assert store.get_desired_instances("acme/llama") == 1
    assert store.list_desired_instances() == {"acme/gemma": 0, "acme/llama": 1}
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_instances"):
            store.set_desired_instances("acme/llama", bad)


def test_deploy_times_are_kept_until_the_model_is_deleted(store, store_location):
    store.put_model_spec(_spec("acme/llama"))
    store.set_deployed_s("acme/llama", 1700000123.25)
    store.set_deployed_s("acme/gemma", 1700000000.0)
    assert store.list_deployed_s() == {"acme/gemma": 1700000000.0, "acme/llama": 1700000123.25}
    with open_state_store(store_location) as reopened:  # durable: another process sees them
        assert reopened.list_deployed_s()["acme/llama"] == 1700000123.25
    assert store.delete_model_spec("acme/llama")
    assert store.list_deployed_s() == {"acme/gemma": 1700000000.0}


def test_worker_registry(store):
    store.put_worker(_worker("i-2", "acme/llama", InstanceState.LOADING))
    store.put_worker(_worker("i-1", "acme/llama"))
    store.put_worker(_worker("i-3", "acme/gemma"))
    assert store.get_worker("i-2") == _worker("i-2", "acme/llama", InstanceState.LOADING)
    assert store.get_worker("i-2").state is InstanceState.LOADING  # read back as the enum, not its value
    assert store.get_worker("i-9") is None
    assert [w.instance_id for w in store.list_workers()] == ["i-1", "i-2", "i-3"]
    assert [w.instance_id for w in store.list_workers(model_id="acme/llama")] == ["i-1", "i-2"]

    store.put_worker(_worker("i-2", "acme/llama", "ready"))  # a stored value is taken as the enum
    assert store.get_worker("i-2").state is InstanceState.READY
    assert store.delete_worker("i-2") is True
    assert store.delete_worker("i-2") is False
    assert [w.instance_id for w in store.list_workers()] == ["i-1", "i-3"]


def test_worker_states_are_the_controllers_phases_and_the_old_spelling_reads_as_loading():
    assert _worker("i-1", state="starting").state is InstanceState.LOADING  # as stores before wire's enum wrote it
    assert _worker("i-1", state="stopping").to_dict()["state"] == "stopping"
    for bad in ("draining", "spare", "failed", InstanceState.STOPPED, 3, None):
        with pytest.raises(ValueError, match="state must be one of loading, ready, asleep, stopping"):
            _worker("i-1", state=bad)


def test_everything_survives_a_restart(store_location):
    """What a killed controller finds when it opens the store again."""
    with open_state_store(store_location) as first:
        first.put_model_spec(_spec("acme/llama", max_instances=3))
        first.add_tenant("acme")
        key = first.create_api_key("acme")
        first.set_desired_instances("acme/llama", 2)
        first.set_tenant_quota("acme", TenantQuota(max_instances=4))
        first.put_worker(_worker("i-1"))

    with open_state_store(store_location) as second:
        assert second.get_model_spec("acme/llama") == _spec("acme/llama", max_instances=3)
        assert second.list_tenants() == ["acme"]
        assert second.verify_api_key(key) == "acme"
        assert second.list_desired_instances() == {"acme/llama": 2}
        assert second.list_tenant_quotas() == {"acme": TenantQuota(max_instances=4)}
        assert second.list_workers() == [_worker("i-1")]


def test_threads_share_one_store(store):
    """Concurrent writers from many threads: nothing lost, nothing raised."""
    store.add_tenant("acme")
    errors: list[BaseException] = []
    keys: list[str] = []
    keys_lock = threading.Lock()

    def writer(thread_index: int) -> None:
        try:
            for i in range(20):
                store.put_worker(_worker(f"t{thread_index}-{i:02d}"))
                store.set_desired_instances("acme/llama", i)
            key = store.create_api_key("acme")
            with keys_lock:
                keys.append(key)
        except BaseException as exc:  # surfaced below, in the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert len(store.list_workers()) == 120
    assert store.get_desired_instances("acme/llama") == 19
    assert [store.verify_api_key(key) for key in keys] == ["acme"] * 6


def test_operations_on_a_closed_store_fail_clearly(store_location):
    opened = open_state_store(store_location)
    opened.close()
    with pytest.raises(StateStoreError, match="is closed"):
        opened.put_worker(_worker("i-1"))
    opened.close()  # closing twice is harmless


# --- SQLite -------------------------------------------------------------------------------------


def test_sqlite_locations(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    with open_state_store(state_dir) as store:
        assert isinstance(store, SqliteStateStore) and store.path == state_dir / "state.sqlite3"
    with open_state_store(f"{tmp_path}/new-dir/") as store:
        assert store.path == tmp_path / "new-dir" / "state.sqlite3"
    with open_state_store(f"sqlite://{tmp_path}/nested/thaw.db") as store:
        assert store.path == tmp_path / "nested" / "thaw.db"
    with open_state_store(str(tmp_path / "plain.db")) as store:
        assert store.path == tmp_path / "plain.db"
    assert (tmp_path / "nested" / "thaw.db").is_file()


def test_sqlite_schema_version_and_bad_files(tmp_path):
    path = tmp_path / "state.sqlite3"
    open_state_store(path).close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StateStoreError, match=f"schema version {SCHEMA_VERSION + 1}, newer than this Thaw's"):
        open_state_store(path)

    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("hello " * 1000)
    with pytest.raises(StateStoreError, match="cannot open the SQLite state store"):
        open_state_store(not_a_db)


def test_sqlite_file_from_before_quotas_gains_the_table_and_keeps_its_data(tmp_path):
    """A state file written by a Thaw without tenant quotas (no such table) opens as it was,
    with the table added and the schema version unchanged."""
    path = tmp_path / "state.sqlite3"
    with open_state_store(path) as store:
        store.add_tenant("acme")
        key = store.create_api_key("acme")
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE tenant_quotas")
    with open_state_store(path) as store:
        assert store.list_tenants() == ["acme"] and store.verify_api_key(key) == "acme"
        assert store.list_tenant_quotas() == {}
        store.set_tenant_quota("acme", TenantQuota(max_queued_requests=5))
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    with open_state_store(path) as store:
        assert store.get_tenant_quota("acme") == TenantQuota(max_queued_requests=5)


def test_sqlite_write_is_all_or_nothing(tmp_path):
    """A failure inside a write transaction leaves no partial change behind."""
    with open_state_store(tmp_path / "s.db") as store:
        store.put_model_spec(_spec("acme/llama"))
        store.set_desired_instances("acme/llama", 2)
        with pytest.raises(RuntimeError, match="boom"):
            with store._write() as conn:
                conn.execute("DELETE FROM model_specs")
                raise RuntimeError("boom")
        assert store.get_model_spec("acme/llama") == _spec("acme/llama")
        assert store.get_desired_instances("acme/llama") == 2


def test_sqlite_two_openers_of_one_file_see_each_other(tmp_path):
    """The controller and a `thaw status` process open the same file."""
    with open_state_store(tmp_path) as controller_side, open_state_store(tmp_path) as cli_side:
        controller_side.put_model_spec(_spec("acme/llama"))
        assert cli_side.get_model_spec("acme/llama") == _spec("acme/llama")
        cli_side.set_desired_instances("acme/llama", 3)
        assert controller_side.get_desired_instances("acme/llama") == 3


# --- Redis --------------------------------------------------------------------------------------


def test_redis_prefixes_isolate_two_platforms(redis_server):
    with open_state_store(f"{redis_server.url}?prefix=one") as one, \
            open_state_store(f"{redis_server.url}?prefix=two") as two:
        assert isinstance(one, RedisStateStore)
        one.put_model_spec(_spec("acme/llama"))
        two.set_desired_instances("acme/llama", 4)
        assert two.get_model_spec("acme/llama") is None
        assert one.get_desired_instances("acme/llama") is None
    client = redis_server.client()
    try:
        assert client.hkeys("one:model_specs") == ["acme/llama"]
        assert client.get("one:schema_version") == str(SCHEMA_VERSION)
        for key in client.keys("one:*") + client.keys("two:*"):
            client.delete(key)
    finally:
        client.close()


def test_redis_schema_version_guard(redis_server):
    client = redis_server.client()
    try:
        client.set("future:schema_version", SCHEMA_VERSION + 1)
        with pytest.raises(StateStoreError, match=f"schema version {SCHEMA_VERSION + 1}, newer than this Thaw's"):
            open_state_store(f"{redis_server.url}?prefix=future")
        client.set("garbage:schema_version", "x")
        with pytest.raises(StateStoreError, match="not a schema version"):
            open_state_store(f"{redis_server.url}?prefix=garbage")
    finally:
        client.delete("future:schema_version", "garbage:schema_version")
        client.close()


def _persistence_records(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "controller.redis_state_store"]


@pytest.fixture
def own_redis_server(tmp_path):
    """A redis-server of this test's own (started, like the session's, with persistence off), so
    changing its configuration touches no other test."""
    server = RedisServer(find_redis_server(), tmp_path)
    yield server
    server.stop()


def test_redis_without_persistence_is_warned_about_at_open(own_redis_server, caplog):
    caplog.set_level(logging.INFO, logger="controller.redis_state_store")
    with open_state_store(own_redis_server.url):
        pass
    [(level, message)] = _persistence_records(caplog)
    assert level == logging.WARNING
    assert message.startswith(f"Redis at {own_redis_server.url} does not persist its data (appendonly no, "
                              f"save \"\"): a restart of Redis loses API keys and their revocations")
    assert "appendonly yes in redis.conf" in message and "save 60 1" in message

    client = own_redis_server.client()
    try:
        for setting, value in (("save", "60 1"), ("appendonly", "yes")):  # either one is persistence
            client.config_set("save", "")
            client.config_set("appendonly", "no")
            client.config_set(setting, value)
            caplog.clear()
            with open_state_store(own_redis_server.url):
                pass
            assert _persistence_records(caplog) == [], setting
    finally:
        client.close()


def test_redis_refusing_config_gets_a_softer_note(own_redis_server, caplog):
    caplog.set_level(logging.INFO, logger="controller.redis_state_store")
    client = own_redis_server.client()
    try:  # a user the server denies CONFIG, as managed services and ACLs do
        client.acl_setuser("thaw", enabled=True, passwords=["+secret"], keys=["*"], commands=["+@all", "-config"])
    finally:
        client.close()
    url = f"redis://thaw:secret@127.0.0.1:{own_redis_server.port}/0"
    with open_state_store(url) as store:
        store.add_tenant("acme")  # the store works all the same
    [(level, message)] = _persistence_records(caplog)
    assert level == logging.INFO
    assert message.startswith(f"could not check whether Redis at redis://thaw:***@127.0.0.1:{own_redis_server.port}/0 "
                              f"persists its data (CONFIG GET refused: ")
    assert "secret" not in message and "appendonly yes, or a save schedule" in message


def test_redis_unreachable_is_a_clear_error():
    port = _free_port()  # nothing listens there
    with pytest.raises(StateStoreError, match=f"cannot reach Redis at redis://127.0.0.1:{port}/0"):
        open_state_store(f"redis://127.0.0.1:{port}/0")


def test_redis_password_is_not_echoed():
    port = _free_port()
    with pytest.raises(StateStoreError) as info:
        open_state_store(f"redis://:hunter2@127.0.0.1:{port}/0")
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("postgres://db/thaw", "unsupported state store URL 'postgres://db/thaw'"),
        ("redis://localhost:6379/zero", "the database must be a number, got 'zero'"),
        ("redis://localhost:notaport/0", "invalid Redis URL"),
        ("redis:///0", "expected redis://host:port/db"),
        ("redis://localhost:6379/0?pool=3", "unknown option(s) pool"),
        ("sqlite://", "no path in 'sqlite://'"),
        ("", "must be a path or URL"),
    ],
)
def test_bad_locations(location, message):
    with pytest.raises(StateStoreError) as info:
        open_state_store(location)
    assert message in str(info.value)



def test_an_api_key_made_elsewhere_is_imported_once_by_its_hash(store):
    from controller import new_api_key

    store.add_tenant("acme")
    store.add_tenant("zeta")
    key = new_api_key()
    assert store.verify_api_key(key) is None
    assert store.import_api_key("acme", key) is True
    assert store.verify_api_key(key) == "acme"
    assert store.import_api_key("acme", key) is False  # already that tenant's: nothing changes
    assert len(store.list_api_keys(tenant="acme")) == 1
    with pytest.raises(ValueError, match="is taken by another key"):
        store.import_api_key("zeta", key)
    with pytest.raises(ValueError, match="is taken by another key"):  # same id, another secret
        store.import_api_key("zeta", key[:-1] + ("A" if key[-1] != "A" else "B"))
    with pytest.raises(ValueError, match="must look like thaw_<16 hex digits>"):
        store.import_api_key("acme", "not-a-key")
    secret = key.split("_", 2)[2]
    assert all(secret not in str(v) for r in store.list_api_keys() for v in r.to_dict().values())
