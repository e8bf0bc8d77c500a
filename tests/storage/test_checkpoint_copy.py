"""Tier-to-tier copies: bit-identical, and a damaged source is refused with the loader's errors."""

from __future__ import annotations

import filecmp
import shutil
import stat

import pytest

from loader import ChecksumMismatchError, TruncatedCheckpointError
from storage.checkpoint_copy import checkpoint_bytes, copy_checkpoint


def test_copy_is_bit_identical(thaw_model_dir, tmp_path):
    index = copy_checkpoint(thaw_model_dir, tmp_path / "copy", num_threads=3)
    names = sorted(p.name for p in thaw_model_dir.iterdir())
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == names
    assert all(filecmp.cmp(thaw_model_dir / n, tmp_path / "copy" / n, shallow=False) for n in names)
    assert checkpoint_bytes(tmp_path / "copy") == checkpoint_bytes(thaw_model_dir)
    assert len(index.partitions[0].chunks) > 1


def test_copy_is_the_owners_only(thaw_model_dir, tmp_path):
    copy_checkpoint(thaw_model_dir, tmp_path / "tier" / "copy")
    assert stat.S_IMODE((tmp_path / "tier").stat().st_mode) == 0o700  # a parent it created, too
    assert stat.S_IMODE((tmp_path / "tier" / "copy").stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "tier" / "copy").iterdir()} == {
        p.name: 0o600 for p in thaw_model_dir.iterdir()}


def test_flipped_bit_is_caught_and_no_index_is_written(thaw_model_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(thaw_model_dir, src)
    with open(src / "partition_000.bin", "r+b") as f:
        f.seek(9000)
        byte = f.read(1)
        f.seek(9000)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumMismatchError, match=r"chunk 1 \(bytes \[8192, 16384\)\)"):
        copy_checkpoint(src, tmp_path / "copy")
    assert not (tmp_path / "copy" / "thaw_index.json").exists()
    copy_checkpoint(src, tmp_path / "unverified", verify=False)  # verification is what caught it


def test_truncated_or_missing_partition(thaw_model_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(thaw_model_dir, src)
    size = (src / "partition_000.bin").stat().st_size
    with open(src / "partition_000.bin", "r+b") as f:
        f.truncate(size - 4096)
    with pytest.raises(TruncatedCheckpointError, match="truncated"):
        copy_checkpoint(src, tmp_path / "a")
    (src / "partition_000.bin").unlink()
    with pytest.raises(TruncatedCheckpointError, match="missing"):
        copy_checkpoint(src, tmp_path / "b")
