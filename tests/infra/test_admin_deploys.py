"""Deploying through the admin API and ``thaw deploy``, over real HTTP: a model's deploy, update,
scale and delete, the controller's refusals as statuses, a deploy job followed to its end (or its
failure) by long polls, and a directory uploaded from this machine in pieces, resumed after an
interruption (`admin_api_server` serves the API).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from controller import DeployConflictError, InvalidSpecError
from infra.admin_client import AdminApiError
from infra.admin_key import ADMIN_TENANT
from infra.source_upload import PIECE_BYTES, ResumeRecords, _listing_key
from tests.infra.admin_api_server import Server, serve_admin_api, spec


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serve_admin_api(tmp_path_factory.mktemp("admin-state")) as running:
        yield running


def test_models_deploy_get_update_scale_delete(server):
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.deploy({"tenant": "acme", "name": "bad", "source": "/m", "autoscaling": {"max_instances": 0}}))
    assert info.value.status == 400 and info.value.param == "autoscaling.max_instances"
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.deploy(spec(f"{ADMIN_TENANT}/m")))
    assert info.value.status == 400 and "reserved" in info.value.message
    deployed = server.call(lambda c: c.deploy(spec("acme/m")))
    assert deployed["name"] == "m" and "acme" in server.store.list_tenants()  # the tenant came with the model
    assert server.call(lambda c: c.deploy(spec("acme/m"))) == deployed  # the same spec again: fine
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.deploy(spec("acme/m", max_instances=3)))
    assert info.value.status == 409 and "update" in info.value.message
    updated = server.call(lambda c: c.update(spec("acme/m", max_instances=3)))
    assert updated["autoscaling"]["max_instances"] == 3
    assert server.call(lambda c: c.get_model("acme/m"))["spec"]["autoscaling"]["max_instances"] == 3
    scaled = server.call(lambda c: c.scale("acme/m", 0, 2))
    assert (scaled["autoscaling"]["min_instances"], scaled["autoscaling"]["max_instances"]) == (0, 2)
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.scale("acme/m", 3, None))
    assert info.value.status == 400 and info.value.param == "autoscaling.max_instances"
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.get_model("acme/missing"))
    assert info.value.status == 404 and "acme/missing" in info.value.message
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.get_model("Acme/m"))
    assert info.value.status == 400 and info.value.param == "tenant"
    assert [s["name"] for s in server.call(lambda c: c.list_models("acme"))] == ["m"]
    assert server.call(lambda c: c.delete("acme/m")) == {"deleted": "acme/m"}
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.delete("acme/m"))
    assert info.value.status == 404


def test_an_unsafe_source_is_400_on_source_and_a_lost_deploy_race_is_409(server):
    # What the controller raises for a source dir with a symlink out of it, and for the loser of
    # two racing deploys of one name (tests/controller/test_controller.py shows it does).
    unsafe = InvalidSpecError("source", "/models/unsafe: 'model.safetensors' is a symlink to /other/model.safetensors, "
                                        "outside the directory; copy the real files into the directory")
    raced = DeployConflictError("acme/raced", "another deploy or update of it is in progress; wait for it to "
                                              "finish (thaw list shows the result), then try again")
    server.controller.refusals = {"/models/unsafe": unsafe, "/models/raced": raced}
    try:
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.deploy({**spec("acme/unsafe"), "source": "/models/unsafe"}))
        assert (info.value.status, info.value.param, info.value.message) == (400, "source", str(unsafe))
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.deploy({**spec("acme/raced"), "source": "/models/raced"}))
        assert (info.value.status, info.value.message) == (409, str(raced))
        result = server.thaw("deploy", "--name", "acme/unsafe", "--source", "/models/unsafe")
        assert result.returncode == 2 and "is a symlink to /other/model.safetensors" in result.stderr
        result = server.thaw("deploy", "--name", "acme/raced", "--source", "/models/raced")
        assert result.returncode == 1 and "another deploy or update of it is in progress" in result.stderr
    finally:
        server.controller.refusals = {}
    assert "acme/unsafe" not in server.controller.specs and "acme/raced" not in server.controller.specs


def test_a_deploy_job_answers_at_once_and_the_cli_follows_it_to_the_end(server):
    big = [("checking", 0, 0), ("converting", 0, 4_000_000), ("converting", 2_000_000, 4_000_000),
           ("uploading", 1_000_000, 8_000_000), ("uploading", 8_000_000, 8_000_000), ("registering", 0, 0)]
    server.controller.scripted = {"/models/big": big}
    try:
        started = server.call(lambda c: c.start_deploy({**spec("acme/big"), "source": "/models/big"}))
        assert (started.state.value, started.stage.value, started.model_id) == ("running", "checking", "acme/big")
        assert server.call(lambda c: c.deploy_status(started.deploy_id)) == started  # no wait: as it is
        step = server.call(lambda c: c.deploy_status(started.deploy_id, wait_s=2.5))
        assert (step.stage.value, step.num_bytes_total) == ("converting", 4_000_000)
        assert server.controller.waits[-1] == (started.deploy_id, 2.5)
        assert [r.deploy_id for r in server.call(lambda c: c.list_deploys())][-1] == started.deploy_id
        for wait_s, param in (("31", "wait_s"), ("-1", "wait_s"), ("nan", "wait_s")):
            with pytest.raises(AdminApiError) as info:
                server.call(lambda c: c._request("GET", f"/admin/deploys/{started.deploy_id}", params={"wait_s": wait_s}))
            assert (info.value.status, info.value.param) == (400, param), wait_s
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.deploy_status("d-none"))
        assert info.value.status == 404 and "no deploy 'd-none'" in info.value.message

        # The CLI: starts the job, draws each stage's bar from the long polls, waits for the end.
        result = server.thaw("deploy", "--name", "acme/big2", "--source", "/models/big")
        assert result.returncode == 0, result.stderr
        assert "deploying acme/big2 (d-" in result.stderr and "acme/big2 deployed in" in result.stderr
        assert "converting" in result.stderr and "uploading" in result.stderr and "registering ..." in result.stderr
        assert "7.63M/7.63M" in result.stderr  # the upload's bar, in tqdm's units (MiB), ran to its end
        assert "acme/big2" in server.controller.specs

        result = server.thaw("deploy", "--name", "acme/big3", "--source", "/models/big", "--no-wait")
        assert result.returncode == 0 and "started as d-" in result.stderr and "thaw deploys d-" in result.stderr
        deploy_id = result.stderr.split("started as ")[1].split(";")[0]
        listing = server.thaw("deploys")
        assert listing.returncode == 0 and deploy_id in listing.stdout and "acme/big3" in listing.stdout
        one = server.thaw("deploys", deploy_id, "--wait", "--json")
        assert one.returncode == 0 and json.loads(one.stdout)[0]["state"] == "succeeded"
    finally:
        server.controller.scripted = {}


def test_a_failed_deploy_job_exits_with_its_reason(server):
    unsafe = InvalidSpecError("source", "/models/gone is not a directory on the controller's machine")
    server.controller.refusals = {"/models/gone": unsafe}
    try:
        result = server.thaw("deploy", "--name", "acme/gone", "--source", "/models/gone")
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().endswith(f"deploy of acme/gone failed: {unsafe}")
        listing = server.thaw("deploys", "--json")
        failed = [d for d in json.loads(listing.stdout) if d["model_id"] == "acme/gone"]
        assert failed and failed[-1]["state"] == "failed" and failed[-1]["error_field"] == "source"
    finally:
        server.controller.refusals = {}
    assert "acme/gone" not in server.controller.specs


def test_deploy_uploads_a_directory_from_this_machine_and_resumes_an_interrupted_upload(server, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (src / "model.safetensors").write_bytes(bytes(range(256)) * (PIECE_BYTES // 256 * 2 + 7))  # three pieces
    (src / ".cache").mkdir()
    (src / ".cache" / "lock").write_text("not sent")  # hidden: not part of the model
    result = server.thaw("deploy", "--name", "acme/up", "--source", str(src), "--upload")
    assert result.returncode == 0, result.stderr
    assert "sending 2 files to the platform" in result.stderr and "acme/up deployed in" in result.stderr
    source = server.controller.specs["acme/up"]["source"]
    upload_id = source.removeprefix("upload:")
    status = server.call(lambda c: c.upload_status(upload_id))
    assert status["sealed"] and status["files"] == {"config.json": (src / "config.json").stat().st_size,
                                                    "model.safetensors": (src / "model.safetensors").stat().st_size}
    assert (server.state_dir / "uploads" / upload_id / "model.safetensors").read_bytes() == (
        src / "model.safetensors").read_bytes()
    assert ResumeRecords(server.state_dir).get(src, server.url, _listing_key([])) is None  # forgotten once deployed

    # An upload cut short: one piece of the weights arrived; the CLI's record of it remains.
    from loader import model_dir_files

    records = ResumeRecords(server.state_dir)
    partial = server.call(lambda c: c.create_upload())
    first = (src / "model.safetensors").read_bytes()[:PIECE_BYTES]
    assert server.call(lambda c: c.upload_piece(partial, "model.safetensors", 0, first)) == PIECE_BYTES
    records.put(src, server.url, _listing_key(model_dir_files(src)), partial)
    before = len(server.controller.pieces)
    result = server.thaw("deploy", "--name", "acme/up2", "--source", str(src), "--upload")
    assert result.returncode == 0, result.stderr
    assert f"({partial}, resuming)" in result.stderr
    assert server.controller.specs["acme/up2"]["source"] == f"upload:{partial}"
    sent = server.controller.pieces[before:]
    assert ("model.safetensors", 0, PIECE_BYTES) not in sent  # the arrived piece was not sent again
    assert [(p, o) for p, o, _ in sent if p == "model.safetensors"] == [("model.safetensors", PIECE_BYTES),
                                                                        ("model.safetensors", 2 * PIECE_BYTES)]

    # Over HTTP: a misplaced piece is a 409 naming where to resume; a bad path a 400; an unknown id a 404.
    fresh = server.call(lambda c: c.create_upload())
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.upload_piece(fresh, "config.json", 5, b"x"))
    assert info.value.status == 409 and "send the piece at offset 0, not 5" in info.value.message
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.upload_piece(fresh, ".git/config", 0, b"x"))  # (a '..' never leaves the client)
    assert (info.value.status, info.value.param) == (400, "path"), info.value.message
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.upload_status("f" * 32))
    assert info.value.status == 404 and "upload the directory again" in info.value.message
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.seal_upload(fresh, {"config.json": {"size": 1, "xxh3_64": "0" * 16}}))
    assert (info.value.status, info.value.param) == (400, "files") and "never uploaded" in info.value.message
    assert server.call(lambda c: c.delete_upload(fresh)) == {"deleted": fresh}
    result = server.thaw("deploy", "--name", "acme/up3", "--source", str(tmp_path / "missing"), "--upload")
    assert result.returncode == 2 and "is not a directory on this machine" in result.stderr
