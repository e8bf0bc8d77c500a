"""Files and directories only their owner can read: a tenant's weights are nobody else's.

Checkpoints pass through several places on a node -- the converter's output, the SSD and DRAM
(tmpfs) tiers, the fetch staging area, a local repository -- and every process that reads them
runs as the platform's user. So each of those places creates its directories 0700 and its files
0600 (`PRIVATE_DIR_MODE`, `PRIVATE_FILE_MODE`) from the start, with the mode given to the
``mkdir``/``open`` call itself: there is no moment in which a file is readable by others and
then tightened. (``Path.mkdir(parents=True)`` gives the parents the default mode, hence
`make_private_dirs`.) The umask can only remove bits, so these modes hold under any umask.
`make_private_tree` tightens a tree written before these modes (a persistent tier's old entries).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_SENDFILE_BYTES = 1 << 30


def make_private_dirs(path: str | Path) -> None:
    """Create `path` and its missing parents, each 0700; existing directories are left as they are."""
    path = Path(path)
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            if not directory.is_dir():
                raise


def make_private_tree(path: str | Path) -> None:
    """Make the directory tree at `path` (a directory, not a link to one) the owner's only
    (directories 0700, files 0600), for files written before these modes; links inside are
    left alone."""
    path = Path(path)
    os.chmod(path, PRIVATE_DIR_MODE)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), PRIVATE_DIR_MODE)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), PRIVATE_FILE_MODE)


def open_private(path: str | Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_EXCL) -> int:
    """``os.open`` creating the file 0600 (an existing file opened without O_EXCL is made 0600 too)."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        if not flags & os.O_EXCL:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str | Path, data: bytes) -> None:
    """Write `data` to a new (or truncated) 0600 file."""
    with os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        f.write(data)


def copy_private(src: str | Path, dst: str | Path) -> None:
    """Copy `src`'s bytes to `dst` (created or truncated, 0600); in-kernel (sendfile) where it can."""
    with open(src, "rb") as fsrc, os.fdopen(open_private(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as fdst:
        size = os.fstat(fsrc.fileno()).st_size
        offset = 0
        try:
            while offset < size:
                n = os.sendfile(fdst.fileno(), fsrc.fileno(), offset, min(size - offset, _SENDFILE_BYTES))
                if n == 0:  # the source shrank under us: copy what is there
                    break
                offset += n
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or offset:
                raise
            shutil.copyfileobj(fsrc, fdst)
