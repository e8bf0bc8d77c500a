"""Owner-only files and directories: the mode is given at creation, whatever the umask."""

from __future__ import annotations

import os
import stat

import pytest

from loader import copy_private, make_private_dirs, make_private_tree, open_private, write_private


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask():
    """The most permissive umask: nothing the process default would hide."""
    previous = os.umask(0)
    yield
    os.umask(previous)


def test_created_owner_only_under_any_umask(tmp_path, open_umask):
    (tmp_path / "existing").mkdir(mode=0o755)
    make_private_dirs(tmp_path / "existing" / "a" / "b")
    assert [_mode(tmp_path / "existing"), _mode(tmp_path / "existing" / "a"),
            _mode(tmp_path / "existing" / "a" / "b")] == [0o755, 0o700, 0o700]  # what existed is left alone
    write_private(tmp_path / "w", b"data")
    os.close(open_private(tmp_path / "o"))
    (tmp_path / "src").write_bytes(b"x" * 100_000)
    os.chmod(tmp_path / "src", 0o644)
    copy_private(tmp_path / "src", tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == b"x" * 100_000 and (tmp_path / "w").read_bytes() == b"data"
    assert [_mode(tmp_path / n) for n in ("w", "o", "copy")] == [0o600, 0o600, 0o600]
    with pytest.raises(FileExistsError):  # O_EXCL by default
        open_private(tmp_path / "o")
    (tmp_path / "loose").write_bytes(b"")
    os.chmod(tmp_path / "loose", 0o666)
    copy_private(tmp_path / "src", tmp_path / "loose")  # an existing file is tightened too
    assert _mode(tmp_path / "loose") == 0o600


def test_make_private_tree_tightens_an_old_tree(tmp_path, open_umask):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True, mode=0o755)
    os.chmod(tree, 0o755)
    (tree / "sub" / "f").write_bytes(b"")
    os.chmod(tree / "sub" / "f", 0o644)
    make_private_tree(tree)
    assert [_mode(tree), _mode(tree / "sub"), _mode(tree / "sub" / "f")] == [0o700, 0o700, 0o600]
