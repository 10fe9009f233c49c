"""The swap directory: where the NVMe tier keeps its files (docs/architecture.md §3).

Lifecycle:
- ``SwapDir(path)`` creates ``path`` with mode ``0700`` (its parent must exist),
  takes an advisory ``flock`` on ``path/.outcore-swap.lock`` so a second run on the
  same directory fails at once with the pid of the first, and writes the pid there.
- ``reserve(file, nbytes)`` preallocates with ``posix_fallocate``: a disk that is
  too small fails *before* training, not in the middle of a step, with the free
  space measured before the attempt (a failed ``posix_fallocate`` may keep what it
  took; the file is cut back to its size) and the bytes still needed.
- A directory another user could swap files in is refused: one reached through a
  symlink owned by, or pointing to a directory owned by, another user, or a
  world-writable directory without the sticky bit (``/tmp`` has it: fine).
- ``close()`` removes what this run created (the whole directory if it made it);
  a crashed run leaves its directory behind, which ``find_leftover_swap_dirs``
  reports (``outcore doctor`` lists them).
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path

from ...bytesize import format_bytes
from ...errors import DiskFullError, SwapDirError

LOCK_NAME = ".outcore-swap.lock"  # marks a directory as an outcore swap dir


def _check_safe(path: Path) -> None:
    """Refuse a swap directory (or its parent) that another user can tamper with.

    Raises:
        SwapDirError: a symlink not ours or to a directory not ours, or a world-writable
            directory without the sticky bit.
    """
    me = os.geteuid()
    for p in (path, path.parent):
        try:
            link = os.lstat(p)
            st = os.stat(p)
        except OSError:  # missing or not accessible: the checks that follow say which
            continue
        if stat.S_ISLNK(link.st_mode) and not {link.st_uid, st.st_uid} <= {me, 0}:  # root may do anything anyway
            raise SwapDirError(f"swap dir {p} is a symlink to a directory owned by another user "
                               f"(uid {st.st_uid}); pass a directory of your own as swap_dir")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise SwapDirError(f"swap dir {p} is writable by every user without the sticky bit, so "
                               "another user could replace its files; chmod o-w it or choose another swap_dir")


class SwapDir:
    """A locked, private swap directory for one run.

    Args:
        path: the directory; created (mode 0700) when missing. Its parent must exist.
        keep: leave the files on ``close()`` (debugging).

    Raises:
        SwapDirError: parent missing, path not a directory, not writable, read-only
            file system, or locked by another live run.
    """

    def __init__(self, path: str | Path, keep: bool = False):
        self.path = Path(path).expanduser().absolute()
        self.keep = keep
        _check_safe(self.path)
        self._files: list[Path] = []
        self._lock_fd = -1
        self._created = False
        parent = self.path.parent
        try:
            parent_ok, exists, is_dir = parent.is_dir(), self.path.exists(), self.path.is_dir()
        except OSError as e:  # e.g. a parent this user may not enter
            raise SwapDirError(f"swap dir {self.path} is not accessible ({e.strerror}); "
                               "choose a swap_dir this user can write") from e
        if not parent_ok:
            raise SwapDirError(f"swap dir parent {parent} does not exist; create it or pass another swap_dir")
        if exists and not is_dir:
            raise SwapDirError(f"swap dir {self.path} exists and is not a directory; pass a directory")
        if not exists:
            try:
                self.path.mkdir(mode=0o700)
            except OSError as e:
                raise SwapDirError(f"cannot create swap dir {self.path}: {e.strerror}; "
                                   "choose a writable swap_dir") from e
            self._created = True
            os.chmod(self.path, stat.S_IRWXU)  # mkdir's mode is filtered by the umask
        self._lock()

    def _lock(self) -> None:
        lock_path = self.path / LOCK_NAME
        # a killed run's directory (its lock file left, unlocked) is this run's to remove once
        # empty, so leftovers do not pile up; a directory the user made is never removed
        self._leftover = not self._created and lock_path.exists()
        try:
            self._lock_fd = hold_lock(lock_path)
        except LockHeld as e:
            raise SwapDirError(f"swap dir {self.path} is in use by another outcore run (pid {e.pid}); "
                               "wait for it to finish or choose another swap_dir") from e
        except OSError as e:
            self._cleanup_created()
            what = "is on a read-only file system" if e.errno == errno.EROFS else f"is not writable ({e.strerror})"
            raise SwapDirError(f"swap dir {self.path} {what}; choose a writable swap_dir") from e

    def _cleanup_created(self) -> None:
        if self._created:
            shutil.rmtree(self.path, ignore_errors=True)

    def file(self, name: str) -> Path:
        """The path of a data file ``name`` inside the directory (removed on close)."""
        if "/" in name or name.startswith("."):
            raise SwapDirError(f"swap file name {name!r} must be a plain file name")
        p = self.path / name
        if p not in self._files:
            self._files.append(p)
        return p

    def reserve(self, fd: int, nbytes: int, name: str = "swap file") -> None:
        """Preallocate ``nbytes`` of an open file so later writes cannot hit ENOSPC.

        Raises:
            DiskFullError: not enough free space, naming what was free before the
                attempt and what the file still needs.
            SwapDirError: another I/O error.
        """
        if nbytes <= 0:
            return
        st = os.fstat(fd)
        need = max(0, nbytes - st.st_blocks * 512)  # what the file does not hold on disk yet
        free = self.free_bytes  # before: a failed fallocate may keep the space it took

        def full() -> DiskFullError:
            return DiskFullError(f"swap dir {self.path} has {format_bytes(free)} free but {name} needs "
                                 f"{format_bytes(need)} more ({format_bytes(nbytes)} in all); free space or "
                                 "choose another swap_dir")
        if need > free:
            raise full()
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                os.ftruncate(fd, st.st_size)  # give back what the failed attempt took
                raise full() from e
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # file system without fallocate: checked above
                return
            raise SwapDirError(f"cannot reserve {format_bytes(nbytes)} in {self.path}: {e.strerror}") from e

    @property
    def free_bytes(self) -> int:
        """Free bytes on the file system of the directory."""
        return shutil.disk_usage(self.path).free

    def close(self) -> None:
        """Remove this run's files (the directory too, if this run created it) and unlock."""
        if self._lock_fd < 0:
            return
        if not self.keep:
            for p in self._files:
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
            try:
                (self.path / LOCK_NAME).unlink()
            except FileNotFoundError:
                pass
            if self._created:
                shutil.rmtree(self.path, ignore_errors=True)
            elif self._leftover:
                try:
                    self.path.rmdir()  # only if empty: the killed run's files, never the user's
                except OSError:
                    pass
        os.close(self._lock_fd)  # releases the flock
        self._lock_fd = -1

    def __enter__(self) -> "SwapDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapDir({str(self.path)!r}, locked={self._lock_fd >= 0})"


class LockHeld(Exception):
    """Another process holds the lock (``pid``: what it wrote there, or ``?``)."""

    def __init__(self, pid: str):
        super().__init__(pid)
        self.pid = pid


def hold_lock(lock_path: Path) -> int:
    """Take an exclusive advisory ``flock`` on ``lock_path`` (created 0600) and write our pid
    there; the lock lasts until the returned descriptor is closed (or the process ends,
    killed or not: the kernel drops it, so a crash never leaves a run locked out).

    Raises:
        LockHeld: another live process holds it.
        OSError: the file cannot be opened (read-only file system, permissions).
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise LockHeld(other) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def is_locked(lock_path: Path) -> bool:
    """Does a live process hold ``lock_path``'s lock (see :func:`hold_lock`)?"""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we may have just taken
    return False


def find_leftover_swap_dirs(root: str | Path) -> list[str]:
    """Swap directories at ``root`` or one level below it that no live run holds.

    A crashed or killed run leaves its directory (with the lock file) behind;
    a running one holds the lock and is not listed.

    Returns:
        Absolute paths, sorted.
    """
    root = Path(root).expanduser().absolute()
    candidates = [root]
    try:
        candidates += [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        pass
    out = []
    for d in candidates:
        lock = d / LOCK_NAME
        if lock.exists() and not is_locked(lock):
            out.append(str(d))
    return sorted(out)
