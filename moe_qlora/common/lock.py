"""One process at a time writes into a run folder: an flock(2) on a file inside it, held for the writer's life.
The kernel drops the lock when its process dies, however it dies (SIGKILL, out of memory), so it is never stale;
the holder's PID is written into the file so that a refused process can name it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".moe-qlora.lock"  # hidden, and no run file: a folder holding only it holds no run
HOLDER_WAIT_S = 1.0  # a holder writes its PID just after locking; how long a refused process waits to read it


class RunDirLocked(Exception):
    """Another live process holds the run folder's lock (a user error: exit code 2)."""

    def __init__(self, folder: Path, pid: str | None, host: str | None):
        self.folder, self.pid, self.host = folder, pid, host
        where = f" on host {host}" if host and host != socket.gethostname() else ""
        who = f"PID {pid}{where}" if pid else "PID not written yet"
        stop = f" (kill {pid})" if pid and not where else ""
        super().__init__(
            f"{folder} is in use by another moe-qlora process ({who}); wait for it to finish or stop "
            f"it{stop}, then run this again"
        )


class LockUnsupported(OSError):
    """The folder's filesystem has no flock (some NFS or Lustre mounts): the folder cannot be locked."""


class RunLock:
    """The lock of one run folder, held from `acquire` until `release`, the end of a `with` block, or the end of
    the process. Also a context manager."""

    def __init__(self, folder: Path, fd: int):
        self.folder, self._fd = folder, fd

    @classmethod
    def acquire(cls, folder: str | Path) -> RunLock:
        """Lock `folder` (created if missing) without waiting; RunDirLocked naming the holder if another process
        has it, LockUnsupported where the filesystem cannot lock. Nothing in the folder is changed when refused."""
        folder = Path(folder)
        fd = None
        while fd is None:  # again only when the file we locked had been removed meanwhile (see open_locked)
            fd = open_locked(folder)
        write_holder(fd)
        return cls(folder, fd)

    def release(self) -> None:
        """Unlock (the PID is cleared first, while still held); a second call does nothing."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:  # the folder was removed under us: nothing left to clear
            pass
        # LOCK_UN, not only close: a forked child sharing this open file would otherwise keep the lock.
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def open_locked(folder: Path) -> int | None:
    """Create `folder` and its lock file if missing, and lock that file: its descriptor, or None if the file was
    removed between our open and our lock (fileio.remove_unused_run_folder removes a run folder that holds only
    its lock file, under that lock): a lock on a file no longer in the folder keeps nobody out."""
    folder.mkdir(parents=True, exist_ok=True)  # mkdir is atomic: two processes creating it both go on
    # Opening never truncates: the holder's PID stays for the next one to read. O_CLOEXEC: a program this
    # process execs (a reward's subprocess) does not inherit the lock and outlive the run with it.
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        lock_or_refuse(fd, folder)
        if is_the_file_at(fd, folder / LOCK_NAME):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def is_the_file_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the one `path` names (same device and inode)."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)


def lock_or_refuse(fd: int, folder: Path) -> None:
    """flock `fd` exclusively without blocking, or raise why not."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirLocked(folder, *read_holder(fd)) from None
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise LockUnsupported(exc.errno, f"{folder}: its filesystem cannot lock files ({exc.strerror})") from exc
        raise


def write_holder(fd: int) -> None:
    """'PID HOST' of this process into the lock file (in one write, so a reader sees all of it or nothing)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)


def read_holder(fd: int, wait_s: float = HOLDER_WAIT_S) -> tuple[str | None, str | None]:
    """(PID, host) the holder wrote; (None, None) if it wrote nothing within `wait_s` (it just took the lock)."""
    deadline = time.monotonic() + wait_s
    while True:
        fields = os.pread(fd, 256, 0).decode(errors="replace").split()
        if fields or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return (fields[0], fields[1] if len(fields) > 1 else None) if fields else (None, None)


def holder_pid(folder: str | Path) -> int | None:
    """The PID written in `folder`'s lock file (that of the holder while one runs), or None."""
    try:
        fields = (Path(folder) / LOCK_NAME).read_text().split()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return int(fields[0]) if fields and fields[0].isdigit() else None


def run_lock_for(path: str | Path) -> RunLock | None:
    """For a command writing `path` into a run (RUN/plots, RUN/adapter.gguf, RUN/merged): the lock of the run
    folder, `path` itself or its parent, whichever holds a run's lock file; None when neither does. Raises
    RunDirLocked while the run is alive."""
    path = Path(path).absolute()
    for folder in (path, path.parent):
        if (folder / LOCK_NAME).is_file():
            return RunLock.acquire(folder)
    return None
