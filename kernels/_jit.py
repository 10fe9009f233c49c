"""``torch.utils.cpp_extension.load`` that a killed build cannot hang.

torch serializes builds of one extension with a ``lock`` file it creates and removes itself
(``FileBaton``). A builder killed mid-build (SIGKILL, the OOM killer, a CI timeout) leaves
that file behind, and every later ``load`` of the extension, in any process, waits on it
forever (pytorch/pytorch#189245). Here every outcore build first takes an OS lock (``flock``)
on a file beside it, which the kernel drops when its holder dies; holding it, a ``lock``
file can only be a dead builder's, so it is removed before torch looks.
"""
from __future__ import annotations

from pathlib import Path


def load_extension(name: str, **kwargs):
    """``cpp_extension.load(name=name, **kwargs)``, recovering from a killed build's lock.

    Holds the flock for the load itself: < 1 s when cached, the compile otherwise (other
    outcore processes loading the same extension wait for it, as torch's own lock makes them).
    """
    from torch.utils import cpp_extension

    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        return cpp_extension.load(name=name, **kwargs)
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # made if missing
    with open(build_dir / "outcore.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or by the kernel if we die
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(name=name, **kwargs)
