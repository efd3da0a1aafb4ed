"""Atomic writes: a file or folder appears complete under its final name, or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def current_umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it; put it straight back
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(target: str | Path):
    """Yield a temporary folder beside `target`; on success it replaces `target` by rename.

    On an exception the temporary folder is removed and an existing `target` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700; the final folder gets what mkdir would
    try:
        yield tmp
        _fsync_tree(tmp)
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            os.rmdir(old)
            os.rename(target, old)
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
