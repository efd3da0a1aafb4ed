"""Atomic writes: a file or folder appears complete under its final name, or not at all. A write that runs out
of disk raises DiskFullError naming the path, the bytes it needed where known and the space left there; one the
filesystem refuses (permissions, a read-only mount, a file where a folder should be) raises UnwritableError
naming the folder and the cause."""

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


class UnwritableError(Exception):
    """A write the filesystem refused: no permission, a read-only file system, a file where a folder should be
    (a user error: exit code 2). The message names the path, the folder in the way and the cause."""

    def __init__(self, path: str | Path, cause: OSError):
        self.path, self.cause = Path(path), cause
        super().__init__(f"cannot write {self.path}: {refusal(self.path, cause)}")


# What a filesystem answers a write it refuses (as opposed to a missing path, or a full disk: DiskFullError).
REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EBUSY, errno.EISDIR}


def nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (as an absolute path)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def refusal(path: Path, cause: OSError) -> str:
    """Why `path` could not be written, naming the folder in the way."""
    folder = nearest_existing(path.parent)
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    if cause.errno == errno.EROFS:
        return f"{folder} is on a read-only file system"
    if cause.errno in (errno.EACCES, errno.EPERM):
        return f"this user may not write in {folder} (permission denied)"
    if cause.errno == errno.EBUSY:
        return "it is in use or a mount point, so it cannot be replaced; write into a folder inside it"
    if cause.errno == errno.ENOENT:
        return f"{folder} takes no new files (a virtual file system such as /proc or /sys?)"
    if cause.errno == errno.EISDIR:
        return "it is a folder, and a file was to be written there"
    return f"{cause.strerror or cause} (in {folder})"


@contextmanager
def unwritable_named(path: str | Path) -> Iterator[None]:
    """Inside, a write the filesystem refuses (REFUSED) raises UnwritableError(path) instead of the bare
    OSError (kept as its cause); every other exception passes unchanged."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in REFUSED or is_disk_full(exc):
            raise
        raise UnwritableError(path, exc) from exc


def check_writable(path: str | Path) -> None:
    """Raise UnwritableError now, before any work, if `path` (a file or folder to be written) could not be: a
    temporary file is made and removed in its nearest existing folder, which is what tells a read-only mount
    or a root-owned folder apart (os.access does not see mount options). Nothing else is created."""
    path = Path(path)
    folder = nearest_existing(path.parent)
    with unwritable_named(path):
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.probe-")
        except FileNotFoundError as exc:  # the folder is there: a file system that makes no files in it (/proc)
            raise UnwritableError(path, exc) from exc
        os.close(fd)
        os.remove(probe)


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


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, leaving the file the mode open() would give it (0666 less the umask): safetensors
    creates its files 0600 whatever the umask, so a server running as another user could not read the weights."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def atomic_write_text(path: str | Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it and a rename."""
    path = Path(path)
    with disk_full_named(path, len(text.encode("utf-8"))), unwritable_named(path):
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
    raises DiskFullError naming `target` (and `needed`, the bytes the folder takes, where the caller knows), a
    write the filesystem refuses beside `target` UnwritableError.
    """
    target = Path(target)
    with disk_full_named(target, needed):
        with _atomic_dir(target) as tmp:
            yield tmp


@contextmanager
def _atomic_dir(target: Path):
    with unwritable_named(target):  # only where the target's folder is written: not around the caller's block
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700; the final folder gets what mkdir would
    try:
        yield tmp
        _fsync_tree(tmp)
        with unwritable_named(target):
            _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` to `target`, an existing `target` moved aside first and removed after."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.rmdir(old)
        os.rename(target, old)
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def removed_if_left_unused(folder: str | Path) -> Iterator[None]:
    """Within the block a run may create `folder` (and its missing parents); when the block fails and the folder
    it created holds nothing but its lock file, it is removed with those parents, so that a run refused at its
    start (bad data, a model folder without weights) leaves no empty run folder behind. A folder that was there
    before is never touched."""
    folder = Path(folder).absolute()
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        yield
    except BaseException:
        if created and remove_unused_run_folder(folder):
            for parent in created[1:]:
                try:
                    parent.rmdir()  # only while empty: another run's folder may have appeared in it
                except OSError:
                    break
        raise


def remove_unused_run_folder(folder: Path) -> bool:
    """Remove `folder` if it holds nothing but a run's lock file, holding that lock while it does (a process that
    holds it is using the folder); True if removed."""
    from moe_qlora.common.lock import LOCK_NAME, RunLock

    def unused() -> bool:
        return folder.is_dir() and all(p.name == LOCK_NAME for p in folder.iterdir())

    if not unused():
        return False
    try:
        lock = RunLock.acquire(folder)
    except Exception:  # another process holds it, or the filesystem cannot lock: not ours to remove
        return False
    with lock:
        if not unused():
            return False
        try:
            (folder / LOCK_NAME).unlink(missing_ok=True)
            folder.rmdir()
        except OSError:  # a file appeared in it meanwhile
            return False
    return True
