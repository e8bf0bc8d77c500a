"""The controller's registry (`controller.model_registry`, through the `Controller` as the admin
API calls it), against the fake cluster and a real local repository: a deploy is validated, pushed
once and persisted; an update replaces the nodes' copies; conflicting names and racing deploys have
one winner; a push that fails half way leaves nothing visible; a checkpoint the engine cannot run,
or a source naming files outside itself, is refused before anything is pushed. Helpers are
test_controller.py's."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading

import pytest

from controller import (DeployConflictError, InvalidSpecError, ModelAlreadyDeployedError, UnknownModelError,
                        open_state_store)
from storage import LocalModelRepository
from tests.controller.test_controller import (MODEL_BYTES, NODE, SERVABLE_CONFIG, Harness, eventually, spec,
                                              write_source)
from tests.storage.conftest import s3_bucket, s3_client, s3_endpoint  # noqa: F401 - fixtures


def test_deploy_validates_pushes_once_and_persists(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            controller = h.controller
            with pytest.raises(InvalidSpecError) as bad:
                await controller.deploy(spec("acme/m1", h.source("m1"), min_instances=2, max_instances=1))
            assert bad.value.field == "autoscaling.max_instances"
            copy = pickle.loads(pickle.dumps(bad.value))  # crosses Ray with its field
            assert (copy.field, copy.reason) == (bad.value.field, bad.value.reason)
            with pytest.raises(InvalidSpecError, match="source: .* is not a directory"):
                await controller.deploy(spec("acme/m1", tmp_path / "missing"))

            stored = await controller.deploy(spec("acme/m1", h.source("m1")))
            repository = LocalModelRepository(tmp_path / "repo")
            pushed_at = repository.describe("acme--m1").pushed_at
            assert stored["tenant"] == "acme" and stored["name"] == "m1"
            assert await controller.deploy(spec("acme/m1", h.source("m1"))) == stored  # same spec: nothing to do
            assert repository.describe("acme--m1").pushed_at == pushed_at  # ... and no second push
            with pytest.raises(ModelAlreadyDeployedError):
                await controller.deploy(spec("acme/m1", h.source("m1"), max_instances=2))

            await controller.deploy(spec("zeta/m2", h.source("m2", seed=2)))
            assert [m["name"] for m in controller.list_models()] == ["m1", "m2"]
            assert [m["tenant"] for m in controller.list_models("zeta")] == ["zeta"]
            with pytest.raises(UnknownModelError):
                controller.get_model("acme/nope")
            with pytest.raises(InvalidSpecError, match="name: must be 'tenant/model'"):
                controller.get_model("no-tenant")
            with pytest.raises(InvalidSpecError, match="tenant: must not contain '..'"):
                await controller.delete("../etc")

        with open_state_store(h.config.state_location) as store:  # durable
            assert [s.model_id for s in store.list_model_specs()] == ["acme/m1", "zeta/m2"]
            assert store.list_tenants() == ["acme", "zeta"]
            assert store.list_desired_instances() == {"acme/m1": 0, "zeta/m2": 0}

    asyncio.run(scenario())


def test_update_with_new_content_replaces_the_nodes_copies(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            source = h.source("m1")
            await h.controller.deploy(spec("acme/m1", source))
            store = h.cluster.stores[NODE]
            store.hold("acme--m1", "dram")
            updated = await h.controller.update(spec("acme/m1", source, max_instances=3))
            assert updated["autoscaling"]["max_instances"] == 3
            assert store.invalidations == []  # same content: the cached copies stay
            (source / "model.safetensors").write_bytes(b"\x07" * MODEL_BYTES)
            await h.controller.update(spec("acme/m1", source, max_instances=3))
            assert store.invalidations == [("acme--m1", "dram"), ("acme--m1", "ssd")]
            with pytest.raises(UnknownModelError):
                await h.controller.update(spec("acme/other", source))
            scaled = await h.controller.scale("acme/m1", max_instances=5)
            assert scaled["autoscaling"]["max_instances"] == 5
            with pytest.raises(InvalidSpecError) as bad:
                await h.controller.scale("acme/m1", min_instances=6)
            assert bad.value.field == "autoscaling.max_instances"

    asyncio.run(scenario())


def test_two_ids_mapping_to_one_repository_name_are_refused(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("a--b/c", h.source("x")))
            with pytest.raises(InvalidSpecError, match="maps to repository model 'a--b--c'"):
                await h.controller.deploy(spec("a/b--c", h.source("y", seed=1)))

    asyncio.run(scenario())


WAIT_S = 30.0  # a guard so a bug fails a test instead of hanging it; never reached when correct


class GatedUploads:
    """Holds every repository upload (they run on the deploy's worker thread) until released."""

    def __init__(self, monkeypatch) -> None:
        self.uploading, self.release = threading.Event(), threading.Event()
        real = LocalModelRepository._upload_file

        def gated(repository, key, path):
            self.uploading.set()
            if not self.release.wait(WAIT_S):
                raise AssertionError("the test never released the upload")
            real(repository, key, path)

        monkeypatch.setattr(LocalModelRepository, "_upload_file", gated)


def test_racing_deploys_of_one_name_exactly_one_wins(tmp_path, monkeypatch):
    async def scenario():
        async with Harness(tmp_path) as h:
            gate = GatedUploads(monkeypatch)
            winner_source = h.source("m1", seed=1)
            first = asyncio.ensure_future(h.controller.deploy(spec("acme/m1", winner_source)))
            try:
                await eventually(gate.uploading.is_set, "the first deploy to be pushing", WAIT_S)
                for source in (winner_source, h.source("m1-other", seed=2)):  # the same spec, or another
                    with pytest.raises(DeployConflictError) as lost:
                        await asyncio.wait_for(h.controller.deploy(spec("acme/m1", source)), WAIT_S)
                    assert isinstance(lost.value, ModelAlreadyDeployedError)  # the admin API's 409
                    assert str(lost.value) == ("model 'acme/m1': another deploy or update of it is in progress; "
                                               "wait for it to finish (thaw list shows the result), then try again")
                copy = pickle.loads(pickle.dumps(lost.value))  # crosses Ray with its fields
                assert (type(copy), copy.model_id, copy.reason) == (DeployConflictError, "acme/m1", lost.value.reason)
            finally:
                gate.release.set()
            stored = await first
            assert stored["name"] == "m1" and [m["name"] for m in h.controller.list_models()] == ["m1"]
            # The winner's objects are whole: a verified fetch gives back exactly its source.
            repository = LocalModelRepository(tmp_path / "repo")
            repository.fetch("acme--m1", tmp_path / "fetched")
            assert (tmp_path / "fetched" / "model.safetensors").read_bytes() == (
                winner_source / "model.safetensors").read_bytes()
            assert await h.controller.deploy(spec("acme/m1", winner_source)) == stored  # done: a no-op again

            gate.uploading.clear()
            gate.release.clear()
            (winner_source / "model.safetensors").write_bytes(b"\x05" * MODEL_BYTES)  # new content: a push
            update = asyncio.ensure_future(h.controller.update(spec("acme/m1", winner_source, max_instances=2)))
            try:
                await eventually(gate.uploading.is_set, "the update to be pushing", WAIT_S)
                with pytest.raises(DeployConflictError, match="another deploy or update of it is in progress"):
                    await asyncio.wait_for(h.controller.update(spec("acme/m1", winner_source, max_instances=3)),
                                           WAIT_S)
            finally:
                gate.release.set()
            assert (await update)["autoscaling"]["max_instances"] == 2
            repository.fetch("acme--m1", tmp_path / "updated")
            assert (tmp_path / "updated" / "model.safetensors").read_bytes() == b"\x05" * MODEL_BYTES

    asyncio.run(scenario())


def test_a_push_that_fails_half_way_leaves_nothing_visible(tmp_path, monkeypatch):
    async def scenario():
        async with Harness(tmp_path) as h:
            source = h.source("m1")
            (source / "config.json").write_text(json.dumps(SERVABLE_CONFIG))
            real = LocalModelRepository._upload_file
            calls = []

            def failing(repository, key, path):
                calls.append(key)
                if key.endswith("model.safetensors"):
                    raise OSError("disk full (simulated)")
                real(repository, key, path)

            monkeypatch.setattr(LocalModelRepository, "_upload_file", failing)
            with pytest.raises(OSError, match="disk full"):
                await h.controller.deploy(spec("acme/m1", source))
            monkeypatch.undo()
            repository = LocalModelRepository(tmp_path / "repo")
            assert len(calls) == 2 and repository.list_models() == [] and repository._list_objects("acme--m1") == []
            assert h.controller.list_models() == []
            await h.controller.deploy(spec("acme/m1", source))  # and the name is free again
            assert [m.model for m in repository.list_models()] == ["acme--m1"]

    asyncio.run(scenario())




@pytest.mark.parametrize("patch, expected", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported (supported: "),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config: quantized checkpoints (awq)"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "RoPE scaling type 'su' is not supported"),
    ({"num_attention_heads": None}, "lacks the required key"),
])
def test_deploy_refuses_a_checkpoint_the_engine_cannot_run_before_pushing(tmp_path, patch, expected):
    async def scenario():
        async with Harness(tmp_path) as h:
            source = h.source("m1")
            config = {**SERVABLE_CONFIG, **patch}
            (source / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
            with pytest.raises(InvalidSpecError) as refused:  # the admin API's 400, param "source"
                await h.controller.deploy(spec("acme/m1", source))
            assert refused.value.field == "source" and expected in refused.value.reason
            assert h.controller.list_models() == []
            assert not (tmp_path / "repo").exists()  # nothing was pushed

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["symlink", "index"])
def test_deploy_refuses_a_source_naming_files_outside_itself(tmp_path, how):
    async def scenario():
        async with Harness(tmp_path) as h:
            theirs = h.source("other-tenant", seed=9)
            source = h.source("m1")
            if how == "symlink":
                (source / "model.safetensors").unlink()
                (source / "model.safetensors").symlink_to(theirs / "model.safetensors")
                expected = f"'model.safetensors' is a symlink to {theirs / 'model.safetensors'}, outside the directory"
            else:
                (source / "model.safetensors.index.json").write_text(json.dumps(
                    {"weight_map": {"lm_head.weight": "../other-tenant/model.safetensors"}}))
                expected = ("model.safetensors.index.json weight_map entry 'lm_head.weight' "
                            "('../other-tenant/model.safetensors') is not a relative path inside the directory")
            with pytest.raises(InvalidSpecError) as refused:  # the admin API's 400, param "source"
                await h.controller.deploy(spec("acme/m1", source))
            assert refused.value.field == "source" and expected in refused.value.reason
            assert "copy the real files into the directory" in refused.value.reason or how == "index"
            assert h.controller.list_models() == []
            assert not (tmp_path / "repo").exists()  # nothing was pushed

    asyncio.run(scenario())


def test_a_source_in_another_bucket_is_copied_pushed_and_the_copy_deleted(tmp_path, monkeypatch, s3_client,  # noqa: F811
                                                                          s3_bucket, s3_endpoint):  # noqa: F811
    """An s3:// source outside the repository (the repository here is local) is read with the
    controller's own S3 settings, pushed like a local dir, and leaves nothing in the downloads dir."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    source = write_source(tmp_path, "m1", seed=3)
    for path in source.iterdir():
        s3_client.put_object(Bucket=s3_bucket, Key=f"published/m1/{path.name}", Body=path.read_bytes())

    async def scenario():
        async with Harness(tmp_path) as h:
            downloads = h.config.state_dir / "downloads"
            first = h.controller.start_deploy(spec("acme/m1", f"s3://{s3_bucket}/published/m1"))
            done = await h.controller.wait_deploy(first.deploy_id, 60)
            assert (done.state.value, done.error) == ("succeeded", None)
            repository = LocalModelRepository(tmp_path / "repo")
            assert repository.describe("acme--m1").source_files[0].path == "model.safetensors"
            assert [(m["tenant"], m["name"]) for m in h.controller.list_models()] == [("acme", "m1")]
            assert list(downloads.iterdir()) == []  # the copy is gone once the repository holds it

            missing = h.controller.start_deploy(spec("acme/m2", f"s3://{s3_bucket}/published/m2"))
            failed = await h.controller.wait_deploy(missing.deploy_id, 60)
            assert (failed.state.value, failed.error_field, failed.error_kind) == ("failed", "source", "invalid")
            assert "holds no files" in failed.error and list(downloads.iterdir()) == []
            assert [(m["tenant"], m["name"]) for m in h.controller.list_models()] == [("acme", "m1")]  # nothing half-deployed

    asyncio.run(scenario())
