"""A partition verified once and unchanged since is not hashed again; any change is."""

import json
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from loader import ChecksumMismatchError, LoaderConfig, ThawCheckpointLoader, convert_checkpoint
from loader.memory_backed import is_memory_backed
from loader.verification_record import RECORD_FILE, SETTLE_NS, FileVersion, record_verified, verified_files
from storage.checkpoint_copy import copy_checkpoint
from tests.loader.hf_checkpoint_builder import llama_tensors, write_hf_checkpoint

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it


def later():
    """A clock past the settling time: the files written by the test count as long unchanged."""
    return time.time_ns() + 2 * SETTLE_NS


@pytest.fixture()
def source():
    return llama_tensors(2, torch.bfloat16, seed=3)


@pytest.fixture()
def ckpt(tmp_path, source):
    hf = write_hf_checkpoint(tmp_path / "hf", source, num_shards=1)
    convert_checkpoint(hf, tmp_path / "thaw", progress=False, chunk_bytes=8192, partition_bytes=64 << 10)
    return tmp_path / "thaw"


def _load(ckpt, config=None, clock_ns=later):
    with ThawCheckpointLoader(ckpt, config, clock_ns=clock_ns) as loader:
        tensors = {name: t.clone() for name, t in loader.wait_all(timeout_s=WAIT_S).items()}
        stats = loader.stats
    return tensors, stats


def _assert_identical(loaded, expected):
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def _partitions(ckpt):
    return sorted(p for p in os.listdir(ckpt) if p.startswith("partition_"))


def _flip_byte_in_place(path, offset=100):
    """Flips one byte of `path` in place, after the clock has moved past the file's timestamps
    (two writes in one tick of the timestamp clock can leave them equal; see the module)."""
    stamped = os.stat(path).st_ctime_ns
    deadline = time.monotonic() + WAIT_S
    probe = f"{path}.tick"
    while True:  # poll: a fresh file's ctime shows when the filesystem's clock has ticked
        with open(probe, "wb") as f:
            f.write(b"x")
        if os.stat(probe).st_ctime_ns > stamped:
            break
        assert time.monotonic() < deadline, "the filesystem clock did not advance"
    os.unlink(probe)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_second_load_of_an_unchanged_checkpoint_hashes_nothing(ckpt, source):
    assert len(_partitions(ckpt)) >= 2  # the record is per partition file
    first, stats = _load(ckpt)
    _assert_identical(first, source)
    assert stats.verified and stats.num_trusted_bytes == 0
    record = json.loads((ckpt / RECORD_FILE).read_text())
    assert sorted(record["files"]) == _partitions(ckpt)

    again, stats = _load(ckpt)
    _assert_identical(again, source)
    assert stats.verified and stats.num_trusted_bytes == stats.total_bytes


def test_files_changed_within_the_settling_time_are_not_recorded(ckpt, source):
    _load(ckpt, clock_ns=time.time_ns)  # the conversion just wrote every file
    assert not (ckpt / RECORD_FILE).exists()
    _, stats = _load(ckpt)
    assert stats.num_trusted_bytes == 0


def test_a_byte_changed_in_place_after_the_record_is_caught(ckpt):
    _load(ckpt)
    victim = ckpt / _partitions(ckpt)[0]
    _flip_byte_in_place(victim)
    with pytest.raises(ChecksumMismatchError, match="partition_000.bin: chunk 0"):
        _load(ckpt)
    # The other partition is still trusted; the changed one is not.
    versions = {name: FileVersion.of(ckpt / name) for name in _partitions(ckpt)}
    assert verified_files(ckpt, versions) == set(_partitions(ckpt)[1:])


def test_a_replaced_file_is_hashed_again(ckpt, source):
    _load(ckpt)
    victim = ckpt / _partitions(ckpt)[-1]
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    replacement = ckpt / "replacement.tmp"
    replacement.write_bytes(bytes(data))
    os.replace(replacement, victim)  # a new inode: a copy made again
    with pytest.raises(ChecksumMismatchError, match=_partitions(ckpt)[-1]):
        _load(ckpt)


def test_trust_verified_off_hashes_every_byte(ckpt, source):
    _load(ckpt)
    tensors, stats = _load(ckpt, LoaderConfig(trust_verified=False))
    _assert_identical(tensors, source)
    assert stats.verified and stats.num_trusted_bytes == 0


def test_a_reconversion_in_place_trusts_nothing_recorded_before(ckpt, tmp_path, source):
    _load(ckpt)
    record = (ckpt / RECORD_FILE).read_text()
    os.replace(ckpt / "thaw_index.json", ckpt / "index.old")
    (ckpt / "thaw_index.json").write_bytes((ckpt / "index.old").read_bytes())  # same bytes, a new file
    os.unlink(ckpt / "index.old")
    assert (ckpt / RECORD_FILE).read_text() == record
    _, stats = _load(ckpt)
    assert stats.num_trusted_bytes == 0


@pytest.mark.parametrize("garbage", ["", "{", "[]", '{"format": 99}', '{"format": 1, "files": 3}'])
def test_a_garbled_record_trusts_nothing_and_is_rewritten(ckpt, source, garbage):
    (ckpt / RECORD_FILE).write_text(garbage)
    tensors, stats = _load(ckpt)
    _assert_identical(tensors, source)
    assert stats.num_trusted_bytes == 0
    assert json.loads((ckpt / RECORD_FILE).read_text())["format"] == 1


def test_recording_where_it_cannot_write_or_find_the_file_records_nothing_and_never_raises(ckpt, tmp_path):
    versions = {name: FileVersion.of(ckpt / name) for name in _partitions(ckpt)}
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    # A "directory" that cannot hold the record: the write fails, nothing raises, nothing recorded.
    assert record_verified(blocker, versions, clock_ns=later) == []
    assert record_verified(ckpt, {"missing.bin": versions[_partitions(ckpt)[0]]}, clock_ns=later) == []
    assert not (ckpt / RECORD_FILE).exists()


def test_a_copy_between_tiers_does_not_carry_the_record(ckpt, tmp_path):
    _load(ckpt)
    copy = copy_checkpoint(ckpt, tmp_path / "copy")
    assert copy.partitions and not (tmp_path / "copy" / RECORD_FILE).exists()


def test_a_mapped_dram_tier_copy_is_faulted_in_not_hashed_once_verified(source):
    if not os.path.isdir("/dev/shm") or not is_memory_backed("/dev/shm"):
        pytest.skip("no memory-backed filesystem here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        hf = write_hf_checkpoint(Path(shm) / "hf", source, num_shards=1)
        path = Path(shm) / "thaw"
        convert_checkpoint(hf, path, progress=False, chunk_bytes=8192)
        _, stats = _load(path)
        assert stats.mapped and stats.num_trusted_bytes == 0
        tensors, stats = _load(path)
        _assert_identical(tensors, source)
        assert stats.mapped and stats.num_trusted_bytes == stats.total_bytes
        _flip_byte_in_place(path / "partition_000.bin")
        with pytest.raises(ChecksumMismatchError):
            _load(path)
