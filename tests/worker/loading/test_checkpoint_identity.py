"""A checkpoint's identity: the same for every copy of a checkpoint (another path, another node, an
instance being streamed its weights that holds only the files beside them), different for other
weights or another tokenizer."""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest

from loader import convert_checkpoint
from worker import DemoModelConfig, checkpoint_identity, write_demo_model
from worker.loading.peer_weights import model_files

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"hf", "v1", "v2"}: a Hugging Face dir, it as a thaw checkpoint, and a retrained model (same
    shapes and files, other weights) as a thaw checkpoint."""
    root = tmp_path_factory.mktemp("identity")
    hf = write_demo_model(root / "hf", TINY_DEMO)
    retrained = write_demo_model(root / "hf-retrained", dataclasses.replace(TINY_DEMO, seed=1))
    convert_checkpoint(hf, root / "v1", progress=False)
    convert_checkpoint(retrained, root / "v2", progress=False)
    return {"hf": hf, "v1": root / "v1", "v2": root / "v2", "hf-retrained": retrained}


def test_an_identity_is_short_and_stable(checkpoints):
    identity = checkpoint_identity(checkpoints["v1"])
    assert re.fullmatch(r"ckpt-[0-9a-f]{16}", identity)
    assert checkpoint_identity(checkpoints["v1"]) == identity


def test_other_weights_give_another_identity(checkpoints):
    # The thaw index carries a checksum of every chunk of the weights: a retraining shows.
    assert checkpoint_identity(checkpoints["v1"]) != checkpoint_identity(checkpoints["v2"])


def test_a_copy_elsewhere_and_a_node_s_own_files_keep_the_identity(checkpoints, tmp_path):
    copy = tmp_path / "some" / "other" / "tier"
    shutil.copytree(checkpoints["v1"], copy)
    (copy / ".thaw-verified.json").write_text("{}")  # a loader's record, this node's own
    assert checkpoint_identity(copy) == checkpoint_identity(checkpoints["v1"])


def test_an_instance_streamed_its_weights_by_a_peer_computes_the_same_identity(checkpoints, tmp_path):
    # A peer-fed instance holds only the files the stream's ticket carries (worker.loading.peer_weights).
    received = tmp_path / "received"
    received.mkdir()
    for name, data in model_files(checkpoints["v1"]):
        (received / name).write_bytes(data)
    assert not any(received.glob("partition_*"))
    assert checkpoint_identity(received) == checkpoint_identity(checkpoints["v1"])


def test_another_tokenizer_gives_another_identity(checkpoints, tmp_path):
    copy = tmp_path / "retokenized"
    shutil.copytree(checkpoints["v1"], copy)
    tokenizer = copy / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # any byte changed
    assert checkpoint_identity(copy) != checkpoint_identity(checkpoints["v1"])


def test_a_hugging_face_dir_is_identified_by_the_files_beside_its_weights(checkpoints):
    # Documented limit: weights are covered through a thaw index only (what the platform serves).
    assert checkpoint_identity(checkpoints["hf"]) == checkpoint_identity(checkpoints["hf-retrained"])
    assert checkpoint_identity(checkpoints["hf"]) != checkpoint_identity(checkpoints["v1"])


def test_a_missing_dir_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found: .*absent"):
        checkpoint_identity(tmp_path / "absent")
