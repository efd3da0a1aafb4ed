"""Atomic writes: a file or folder appears complete under its final name, or not at all. A write that runs out
of disk raises DiskFullError naming the path, the bytes it needed where known and the space left there."""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")


class DiskFullError(Exception):
    """A write found no space left on its device (ENOSPC / EDQUOT, or safetensors' SafetensorError for it)."""

    def __init__(self, path: str | Path, needed: int | None, free: int | None):
        self.path, self.needed, self.free = Path(path), needed, free
        need = f"it needs {human_bytes(needed)}, " if needed is not None else ""
        left = f"{human_bytes(free)} free there" if free is not None else "the free space is unknown"
        super().__init__(f"no space left on device writing {self.path} ({need}{left})")


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def is_disk_full(exc: BaseException) -> bool:
    """What a full disk raises: OSError ENOSPC / EDQUOT (open().write, os.replace, torch), numpy's
    OSError('2048 requested and 1624 written') from ndarray.tofile (gguf's writer), or safetensors'
    SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, OSError) and SHORT_WRITE.search(str(exc)):  # numpy's tofile (gguf): a short write, no errno
        return True
    return type(exc).__name__ == "SafetensorError" and ("os error 28" in str(exc) or "No space left" in str(exc))


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem of `path` (or of its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


@contextmanager
def disk_full_named(path: str | Path, needed: int | None = None) -> Iterator[None]:
    """Inside, a full disk raises DiskFullError(path, needed, free) instead of the bare error (kept as its
    cause); every other exception passes unchanged."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, DiskFullError) or not is_disk_full(exc):
            raise
        raise DiskFullError(path, needed, free_bytes(path)) from exc


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def current_umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it; put it straight back
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it and a rename."""
    path = Path(path)
    with disk_full_named(path, len(text.encode("utf-8"))):
        _atomic_write_text(path, text)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@contextmanager
def atomic_dir(target: str | Path, needed: int | None = None):
    """Yield a temporary folder beside `target`; on success it replaces `target` by rename.

    On an exception the temporary folder is removed and an existing `target` is left untouched; a full disk
    raises DiskFullError naming `target` (and `needed`, the bytes the folder takes, where the caller knows).
    """
    target = Path(target)
    with disk_full_named(target, needed):
        with _atomic_dir(target) as tmp:
            yield tmp


@contextmanager
def _atomic_dir(target: Path):
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
