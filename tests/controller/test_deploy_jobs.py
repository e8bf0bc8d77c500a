"""Deploys as jobs (`controller.deploy_jobs`, through `Controller.start_deploy` as the admin API
calls it), against the fake cluster and a real local repository: a deploy answers at once and
reports its stages and bytes while the upload is held; what can be refused at once is; a failed
job says why and leaves nothing visible; the rate and ETA come from the reported bytes; a
controller that shuts down mid-deploy ends the job with a message. Helpers are test_controller.py's."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
import xxhash

from controller import (DeployConflictError, InvalidSpecError, InvalidUploadError, UnknownDeployError,
                        UnknownModelError, UnknownUploadError)
from controller.deploy_jobs import DeployJob, DeployJobs, deploy_error_message
from storage import LocalModelRepository, RepositoryError
from tests.controller.test_controller import MODEL_BYTES, SERVABLE_CONFIG, Harness, eventually, spec
from tests.controller.test_model_registry import WAIT_S, GatedUploads
from wire import DeployProgress, DeployStage, DeployState


def test_a_deploy_answers_at_once_and_reports_its_upload_while_it_runs(tmp_path, monkeypatch):
    async def scenario():
        async with Harness(tmp_path) as h:
            gate = GatedUploads(monkeypatch)
            source = h.source("m1")
            first = h.controller.start_deploy(spec("acme/m1", source))
            assert (first.model_id, first.action, first.finished) == ("acme/m1", "deploy", False)
            try:
                await eventually(gate.uploading.is_set, "the deploy to be uploading", WAIT_S)
                running = h.controller.deploy_progress(first.deploy_id)
                assert running.state is DeployState.RUNNING and running.stage is DeployStage.UPLOADING
                assert running.num_bytes_total >= MODEL_BYTES and running.num_bytes_done < running.num_bytes_total
                assert h.controller.list_models() == []  # nothing visible before it is done
                assert [d["deploy_id"] for d in h.controller.status()["deploys"]] == [first.deploy_id]
                with pytest.raises(DeployConflictError):  # a second deploy of it is refused at once
                    h.controller.start_deploy(spec("acme/m1", source))
                unfinished = await h.controller.wait_deploy(first.deploy_id, 0.01)  # a long poll that times out
                assert not unfinished.finished
            finally:
                gate.release.set()
            done = await h.controller.wait_deploy(first.deploy_id, WAIT_S)
            assert done.state is DeployState.SUCCEEDED and done.stage is DeployStage.DONE
            assert done.spec["name"] == "m1" and done.finished_s >= done.started_s and done.error is None
            assert [m["name"] for m in h.controller.list_models()] == ["m1"]
            again = h.controller.start_deploy(spec("acme/m1", source))  # the same spec: done at once
            assert again.state is DeployState.SUCCEEDED and again.deploy_id != first.deploy_id
            assert pickle.loads(pickle.dumps(done)) == done  # crosses Ray as its tagged dict

    asyncio.run(scenario())


def test_what_can_be_refused_at_once_is_and_a_failed_job_says_why(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            with pytest.raises(InvalidSpecError) as bad:
                h.controller.start_deploy(spec("acme/m1", h.source("m1"), min_instances=2, max_instances=1))
            assert bad.value.field == "autoscaling.max_instances"
            with pytest.raises(UnknownModelError):
                h.controller.start_deploy(spec("acme/none", h.source("m1")), update=True)
            with pytest.raises(UnknownDeployError, match="no deploy 'nope'"):
                h.controller.deploy_progress("nope")

            record = h.controller.start_deploy(spec("acme/m1", tmp_path / "missing"))  # found out by the job
            failed = await h.controller.wait_deploy(record.deploy_id, WAIT_S)
            assert failed.state is DeployState.FAILED and failed.error_kind == "invalid"
            assert failed.error_field == "source" and "is not a directory" in failed.error
            assert h.controller.list_models() == []
            retried = h.controller.start_deploy(spec("acme/m1", h.source("m1")))  # the id is free again
            assert (await h.controller.wait_deploy(retried.deploy_id, WAIT_S)).state is DeployState.SUCCEEDED

    asyncio.run(scenario())


def test_an_upload_that_fails_ends_the_job_with_nothing_visible(tmp_path, monkeypatch):
    async def scenario():
        async with Harness(tmp_path) as h:
            source = h.source("m1")
            (source / "config.json").write_text(json.dumps(SERVABLE_CONFIG))

            def failing(repository, key, path):
                raise OSError(28, "No space left on device")

            monkeypatch.setattr(LocalModelRepository, "_upload_file", failing)
            record = h.controller.start_deploy(spec("acme/m1", source))
            failed = await h.controller.wait_deploy(record.deploy_id, WAIT_S)
            assert (failed.error_kind, failed.error) == (
                "failed", "reading or writing the checkpoint failed: No space left on device")
            assert h.controller.list_models() == [] and LocalModelRepository(tmp_path / "repo").list_models() == []

    asyncio.run(scenario())


def test_a_controller_shut_down_mid_deploy_ends_the_job_and_shows_nothing(tmp_path, monkeypatch):
    async def scenario():
        h = Harness(tmp_path)
        async with h:
            gate = GatedUploads(monkeypatch)
            record = h.controller.start_deploy(spec("acme/m1", h.source("m1")))
            await eventually(gate.uploading.is_set, "the deploy to be uploading", WAIT_S)
            closing = asyncio.ensure_future(h.controller.shutdown(stop_workers=False))
            await eventually(lambda: h.controller.deploy_progress(record.deploy_id).finished, "the job to end",
                             WAIT_S)
            failed = h.controller.deploy_progress(record.deploy_id)
            assert failed.error.startswith("the controller shut down before the deploy finished")
            gate.release.set()  # the push's thread goes on, unwatched
            await closing
        assert h.controller.list_models() == []

    asyncio.run(scenario())


def test_rate_and_eta_come_from_the_reported_bytes():
    now = [100.0]
    job = DeployJob("d-1", "acme/m", "deploy", wall_clock=lambda: 1_000.0, clock=lambda: now[0])
    assert job.record().state is DeployState.PENDING and job.record().bytes_per_s is None
    job.report(DeployStage.CONVERTING, 0, 4_000)
    now[0] += 2.0
    job.report(DeployStage.CONVERTING, 1_000, 4_000)
    record = job.record()
    assert (record.state, record.bytes_per_s, record.eta_s) == (DeployState.RUNNING, 500.0, 6.0)
    job.report(DeployStage.UPLOADING, 0, 8_000)  # a new stage restarts the rate's clock
    now[0] += 1.0
    job.report(DeployStage.UPLOADING, 2_000, 8_000)
    assert (job.record().bytes_per_s, job.record().eta_s) == (2_000.0, 3.0)
    job.fail("boom", "source", "invalid")
    final = job.record()
    assert (final.state, final.error, final.error_field, final.bytes_per_s, final.finished_s) == (
        DeployState.FAILED, "boom", "source", None, 1_000.0)


def test_error_messages_never_carry_internal_text():
    assert deploy_error_message(InvalidSpecError("source", "not a dir")) == ("source: not a dir", "source", "invalid")
    assert deploy_error_message(DeployConflictError("a/b", "raced"))[2] == "conflict"
    assert deploy_error_message(UnknownModelError("a/b"))[2] == "not_found"
    assert deploy_error_message(RepositoryError("bucket gone")) == ("the model repository failed: bucket gone",
                                                                   None, "failed")
    message, field, kind = deploy_error_message(KeyError("secret internal detail"))
    assert "secret" not in message and "KeyError" in message and (field, kind) == (None, "failed")


def test_finished_jobs_are_forgotten_oldest_first_running_ones_never():
    async def scenario():
        jobs = DeployJobs(keep=2)
        release = asyncio.Event()

        async def slow(job):
            await release.wait()
            return {"name": "slow"}

        running = jobs.start("acme/slow", "deploy", slow)
        ids = [jobs.finished(f"acme/m{i}", "deploy", {"name": f"m{i}"}).deploy_id for i in range(4)]
        assert [r.deploy_id for r in jobs.recent()] == [running.deploy_id, *ids[2:]]
        with pytest.raises(UnknownDeployError):
            jobs.get(ids[0])
        release.set()
        assert (await jobs.wait(running.deploy_id)).spec == {"name": "slow"}

    asyncio.run(scenario())


def test_the_record_checks_its_fields():
    base = dict(deploy_id="d-1", model_id="acme/m", action="deploy", state="running", stage="uploading")
    assert DeployProgress(**base).stage is DeployStage.UPLOADING
    with pytest.raises(ValueError, match="deploy_progress.stage must be one of"):
        DeployProgress(**{**base, "stage": "copying"})
    with pytest.raises(ValueError, match="error must be set exactly when the deploy failed"):
        DeployProgress(**{**base, "state": "failed", "finished_s": 1.0})
    with pytest.raises(ValueError, match="finished_s must be set exactly when"):
        DeployProgress(**{**base, "state": "succeeded"})
    assert DeployProgress.from_dict(DeployProgress(**base).to_dict()) == DeployProgress(**base)


def test_a_deploy_from_an_upload_reads_it_and_deletes_it_once_deployed(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            source = h.source("m1")
            upload_id = await h.controller.create_upload()
            listed = {}
            for path in sorted(source.iterdir()):
                data = path.read_bytes()
                half = len(data) // 2
                assert await h.controller.upload_piece(upload_id, path.name, 0, data[:half]) == half
                assert await h.controller.upload_piece(upload_id, path.name, half, data[half:]) == len(data)
                listed[path.name] = {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
            with pytest.raises(InvalidUploadError, match="not sealed yet"):  # refused at once
                h.controller.start_deploy(spec("acme/m1", f"upload:{upload_id}"))
            assert (await h.controller.seal_upload(upload_id, listed))["sealed"] is True
            with pytest.raises(UnknownUploadError):
                h.controller.start_deploy(spec("acme/m1", "upload:" + "0" * 32))
            record = h.controller.start_deploy(spec("acme/m1", f"upload:{upload_id}"))
            done = await h.controller.wait_deploy(record.deploy_id, WAIT_S)
            assert done.state is DeployState.SUCCEEDED, done.error
            assert done.spec["source"] == f"upload:{upload_id}"  # where it came from, as deployed
            fetched = tmp_path / "fetched"
            LocalModelRepository(tmp_path / "repo").fetch("acme--m1", fetched)
            assert (fetched / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
            with pytest.raises(UnknownUploadError):  # the repository holds it now
                await h.controller.upload_status(upload_id)

    asyncio.run(scenario())
