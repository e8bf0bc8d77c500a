"""Mapping checkpoints on memory-backed filesystems: the mountinfo parser, zero-copy loads, integrity."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from loader import ChecksumMismatchError, LoaderConfig, ThawCheckpointLoader, convert_checkpoint, load_checkpoint
from loader.memory_backed import is_memory_backed, map_read_only, mount_fs_type, populate
from tests.loader.hf_checkpoint_builder import llama_tensors, write_hf_checkpoint

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
40 27 0:40 / /mnt/my\\040disk rw shared:5 - ramfs none rw
41 27 0:41 / /data rw - ext4 /dev/vdb rw
42 41 0:42 / /data rw - tmpfs tmpfs rw
"""

SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(not (SHM.is_dir() and is_memory_backed(SHM)), reason="no tmpfs at /dev/shm")


@pytest.mark.parametrize("path, fs_type", [
    ("/dev/shm/thaw/model", "tmpfs"),
    ("/dev/shm", "tmpfs"),
    ("/dev/shmem", "ext4"),  # a prefix of the name is not inside the mount
    ("/home/x", "ext4"),
    ("/mnt/my disk/ckpt", "ramfs"),  # octal-escaped space, optional fields before the separator
    ("/data/ckpt", "tmpfs"),  # mounted over: the later line wins
])
def test_mount_fs_type_picks_the_longest_latest_mount(path, fs_type):
    assert mount_fs_type(MOUNTINFO, path) == fs_type


def test_mount_fs_type_without_a_match_or_on_garbage():
    assert mount_fs_type("", "/x") is None
    assert mount_fs_type("not a mountinfo line\n", "/x") is None


def test_a_disk_directory_is_not_memory_backed(tmp_path):
    if is_memory_backed(tmp_path):
        pytest.skip("the temporary directory is itself on tmpfs here")
    assert not is_memory_backed(tmp_path)


@pytest.fixture
def shm_checkpoint(tmp_path):
    """A converted 2-layer bf16 checkpoint copied into /dev/shm (removed afterwards)."""
    source = llama_tensors(2, torch.bfloat16, seed=3)
    hf = write_hf_checkpoint(tmp_path / "hf", source)
    convert_checkpoint(hf, tmp_path / "thaw", chunk_bytes=8192, progress=False)
    shm_dir = Path(tempfile.mkdtemp(prefix="thaw-test-", dir=SHM))
    try:
        shutil.copytree(tmp_path / "thaw", shm_dir / "ckpt")
        yield shm_dir / "ckpt", source
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


@needs_shm
@pytest.mark.parametrize("verify", [True, False])
def test_a_checkpoint_in_tmpfs_is_mapped_bit_identical(shm_checkpoint, verify):
    ckpt, source = shm_checkpoint
    tensors, stats = load_checkpoint(ckpt, LoaderConfig(verify_checksums=verify))
    assert stats.mapped and stats.verified is verify and stats.num_bytes == stats.total_bytes
    assert sorted(tensors) == sorted(source)
    for name, tensor in source.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name


@needs_shm
def test_mapped_tensors_are_the_files_pages_not_a_copy(shm_checkpoint):
    ckpt, source = shm_checkpoint
    tensors, _ = load_checkpoint(ckpt)
    name = "model.embed_tokens.weight"
    before = tensors[name].clone()
    partition = sorted(ckpt.glob("partition_*.bin"))[0]  # the embedding comes first
    with open(partition, "r+b") as f:  # rewrite the whole partition in place: the view must see it
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        f.write(bytes(size))
    assert torch.count_nonzero(tensors[name]) == 0 and torch.count_nonzero(before) > 0


@needs_shm
def test_a_flipped_byte_in_tmpfs_still_fails_the_mapped_load(shm_checkpoint):
    ckpt, _ = shm_checkpoint
    partition = sorted(ckpt.glob("partition_*.bin"))[0]
    with open(partition, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ChecksumMismatchError, match=partition.name):
        load_checkpoint(ckpt)


@needs_shm
def test_the_read_path_is_kept_when_mapping_is_off(shm_checkpoint):
    ckpt, source = shm_checkpoint
    with ThawCheckpointLoader(ckpt, LoaderConfig(map_memory_backed=False)) as loader:
        tensors = loader.wait_all()
        assert not loader.stats.mapped
        assert torch.equal(tensors["model.norm.weight"], source["model.norm.weight"])
        del tensors


@needs_shm
def test_a_mapping_outlives_the_unlinked_file_and_populate_faults_it_in():
    fd, path = tempfile.mkstemp(dir=SHM)
    try:
        os.write(fd, bytes(range(256)) * 64)  # 16 KiB
    finally:
        os.close(fd)
    mapped = map_read_only(path, 16384)  # [16384] uint8
    os.unlink(path)
    populate(mapped, 4096, 8192)
    assert mapped.shape == (16384,) and int(mapped[4096 + 7]) == 7 and int(mapped[-1]) == 255
