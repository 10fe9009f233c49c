"""Faults of the NVMe tier: bad swap dirs, full disks, corruption, crashes, a second run."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from outcore.errors import EXIT_DISK_FULL, DiskFullError, IntegrityError, SwapDirError
from outcore.offload.aligned import aligned_empty
from outcore.offload.store import directio, nvme as nvme_mod, swapdir as swapdir_mod
from outcore.offload.store import LOCK_NAME, Residency, SwapDir, Tier, TieredStore, find_leftover_swap_dirs
from outcore.offload.store.nvme import DATA_FILE, NvmeBackend

MiB = 1 << 20


def test_swap_dir_created_private_and_removed(tmp_path):
    p = tmp_path / "swap"
    with SwapDir(p) as sd:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700
        assert (p / LOCK_NAME).read_text().strip() == str(os.getpid())
        sd.file("a.bin").write_bytes(b"x")
    assert not p.exists()


def test_existing_swap_dir_is_kept_but_emptied(tmp_path):
    (tmp_path / "mine.txt").write_text("user data")
    with SwapDir(tmp_path) as sd:
        sd.file("extents.bin").write_bytes(b"x")
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]


def test_swap_dir_parent_missing(tmp_path):
    with pytest.raises(SwapDirError, match=f"{tmp_path}/nope does not exist"):
        SwapDir(tmp_path / "nope" / "swap")


def test_swap_dir_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(SwapDirError, match="is not a directory"):
        SwapDir(tmp_path / "f")


def _as_nobody(target) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import os, sys
        from outcore.errors import SwapDirError
        from outcore.offload.store.swapdir import SwapDir
        os.setgid(65534); os.setuid(65534)  # drop root after imports: root may write anywhere
        try:
            SwapDir({str(target)!r})
        except SwapDirError as e:
            print(e); sys.exit(3)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root to user nobody")
def test_swap_dir_not_writable_or_not_accessible_real_user(tmp_path):
    """A real unprivileged process on directories it cannot write or enter."""
    open_parent = tempfile.mkdtemp(dir="/tmp")  # tmp_path's parents are 0700: nobody cannot enter them
    try:
        os.chmod(open_parent, 0o755)
        target = os.path.join(open_parent, "ro")
        os.mkdir(target, 0o755)  # owned by root: nobody may read, not write
        r = _as_nobody(target)
        assert r.returncode == 3, r.stderr
        assert target in r.stdout and "not writable" in r.stdout
    finally:
        shutil.rmtree(open_parent)
    r = _as_nobody(tmp_path / "swap")
    assert r.returncode == 3, r.stderr
    assert "not accessible" in r.stdout and str(tmp_path / "swap") in r.stdout


def test_swap_dir_read_only_fs(tmp_path, monkeypatch):
    real_open = os.open

    def erofs(path, flags, *a, **k):
        if str(path).endswith(LOCK_NAME):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(swapdir_mod.os, "open", erofs)
    with pytest.raises(SwapDirError, match=f"swap dir {tmp_path} is on a read-only file system"):
        SwapDir(tmp_path)


def test_second_process_on_same_swap_dir_is_refused(tmp_path):
    p = tmp_path / "swap"
    code = textwrap.dedent(f"""
        import sys, time
        from outcore.offload.store.swapdir import SwapDir
        sd = SwapDir({str(p)!r}); print("locked", flush=True); time.sleep(60)
    """)
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        with pytest.raises(SwapDirError, match=rf"in use by another outcore run \(pid {other.pid}\)"):
            SwapDir(p)
        assert find_leftover_swap_dirs(tmp_path) == []  # a live run is not a leftover
    finally:
        other.kill()
        other.wait()
    assert find_leftover_swap_dirs(tmp_path) == [str(p)]
    with SwapDir(p):  # the dead run's lock is gone with its process
        pass


def test_too_small_disk_fails_before_training(tmp_path, monkeypatch):
    def enospc(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(swapdir_mod.os, "posix_fallocate", enospc)
    with pytest.raises(SwapDirError, match=r"free but the NVMe tier \(extents.bin\) needs 4.00 GiB"):
        TieredStore(MiB, MiB, nvme_bytes=4 << 30, swap_dir=tmp_path / "s", device="cpu")
    assert not (tmp_path / "s").exists()  # nothing left behind


def test_disk_full_during_write_is_a_clear_error(tmp_path, monkeypatch):
    with TieredStore(MiB, MiB, nvme_bytes=4 * MiB, swap_dir=tmp_path / "s", device="cpu") as s:
        h = s.register("w", data=torch.ones(1000))
        t = s.fetch(h, "host").result()
        t.fill_(2)
        s.mark_dirty(h, "host")

        def full(fd, bufs, off):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(directio.os, "pwritev", full)
        with pytest.raises(SwapDirError, match=r"is full writing extent 'w'"):
            s.write_back(h).result()
        monkeypatch.undo()
        assert torch.equal(s.view(h, "host"), torch.full((1000,), 2.0))  # the dirty copy is kept
        s.write_back(h).result()
        s.release(h, "host")
        assert torch.equal(s.load(h), torch.full((1000,), 2.0))


@pytest.mark.parametrize("where", [0, 1, 4095, 4096, 12345, -1])
def test_any_flipped_byte_is_detected(tmp_path, where):
    with TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu") as s:
        x = torch.randn(5000)  # 20000 bytes -> a 20480-byte extent, with padding
        h = s.register("layer.0", data=x)
        ext = h.copies[h.home].slot
        pos = ext.offset + (where % ext.length)
        with open(s.nvme.path, "r+b") as f:
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x01]))
        with pytest.raises(IntegrityError, match=rf"checksum mismatch in swap file .*{DATA_FILE}, extent 'layer.0'"):
            s.fetch(h, "device").result()
        assert s.held(Tier.DEVICE) == 0 and h.residency(Tier.DEVICE) is Residency.ABSENT  # nothing half-fetched
        with pytest.raises(IntegrityError):
            s.load(h)


def test_truncated_swap_file_is_detected(tmp_path):
    with TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu") as s:
        a = s.register("a", data=torch.ones(2048))
        b = s.register("b", data=torch.ones(2048))
        os.truncate(s.nvme.path, b.copies[b.home].slot.offset + 100)
        with pytest.raises(IntegrityError, match=r"truncated: extent 'b'"):
            s.fetch(b, "host").result()
        assert torch.equal(s.fetch(a, "host").result(), torch.ones(2048))


def test_buffered_fallback_without_o_direct(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(directio.os, "open", no_direct)
    with TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu") as s:
        assert s.nvme.direct is False
        x = torch.randn(777)
        h = s.register("x", data=x)
        assert torch.equal(s.fetch(h, "device").result(), x)


_CHILD = textwrap.dedent("""
    import sys, torch
    from outcore.offload.aligned import aligned_empty
    from outcore.offload.store.nvme import NvmeBackend
    from outcore.offload.store.swapdir import SwapDir
    sd = SwapDir(sys.argv[1], keep=True)
    nv = NvmeBackend(sd, capacity=64 << 20)
    ext = nv.alloc("w", 32 << 20)
    buf = aligned_empty(ext.length)
    buf.fill_(1)
    nv.write(ext, buf, durable=True).result()
    print("first", flush=True)
    v = 2
    while True:  # overwrite forever with new values until killed
        buf.fill_(v % 250 + 2)
        nv.write(ext, buf).result()
        v += 1
""")


@pytest.mark.slow(ci=True)
def test_killed_mid_write_never_reads_back_a_torn_extent(tmp_path):
    """A real process is SIGKILLed while writing; what is read back is whole or refused."""
    outcomes = set()
    for attempt in range(2):
        p = tmp_path / f"swap{attempt}"
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(p)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "first"
        time.sleep(0.05 + 0.13 * attempt)
        child.send_signal(signal.SIGKILL)
        child.wait()
        with SwapDir(p) as sd:  # the lock died with the child
            nv, table = NvmeBackend.recover(sd)
            ext = table["w"]
            buf = aligned_empty(ext.length)
            try:
                nv.read(ext, buf).result()
            except IntegrityError as e:
                assert "extent 'w'" in str(e)
                outcomes.add("refused")
            else:
                vals = torch.unique(buf)
                assert vals.numel() == 1, f"torn extent read back as valid: values {vals.tolist()}"
                outcomes.add("whole")
            nv.close()
    assert outcomes  # every attempt ended whole or refused


def test_recover_rebuilds_extents_and_ignores_a_torn_journal_line(tmp_path):
    p = tmp_path / "swap"
    sd = SwapDir(p, keep=True)
    nv = NvmeBackend(sd, capacity=MiB)
    exts = [nv.alloc(f"k{i}", 10_000) for i in range(3)]
    for i, e in enumerate(exts):
        b = aligned_empty(e.length)
        b.fill_(i + 1)
        nv.write(e, b).result()
    nv.close()
    with open(nv.index_path, "ab") as f:
        f.write(b"k0\t0\t12288\t123")  # a line torn by a crash: no checksum, no newline
    sd.close()
    with SwapDir(p) as sd2:
        nv2, table = NvmeBackend.recover(sd2)
        assert sorted(table) == ["k0", "k1", "k2"]
        for i, k in enumerate(["k0", "k1", "k2"]):
            b = aligned_empty(table[k].length)
            nv2.read(table[k], b).result()
            assert torch.all(b == i + 1)
        new = nv2.alloc("k3", 4096)  # recovered extents are not handed out again
        assert all(new.offset >= e.offset + e.length or new.offset + new.length <= e.offset
                   for e in table.values())
        nv2.close()


def test_journal_is_compacted_and_recovers_the_newest_writes(tmp_path, monkeypatch):
    """A long run rewrites an extent many times: the journal is compacted to one line per
    live extent as it fills (bounded, not a line per write forever), atomically, and
    recovery from it gives each extent's newest write; a freed extent is forgotten."""
    monkeypatch.setattr(nvme_mod, "JOURNAL_COMPACT_MIN", 8)
    p = tmp_path / "swap"
    sd = SwapDir(p, keep=True)
    nv = NvmeBackend(sd, capacity=MiB)
    exts = [nv.alloc(f"k{i}", 4096) for i in range(3)]
    gone = nv.alloc("gone", 4096)
    b = aligned_empty(4096)
    nv.write(gone, b).result()
    nv.free(gone)
    lines = []
    for round_ in range(20):
        for i, e in enumerate(exts):
            b.fill_(round_ * 3 + i)
            nv.write(e, b).result()
        lines.append(len(nv.index_path.read_bytes().splitlines()))
    assert max(lines) <= max(8, 4 * 3) + 1 and min(lines) < max(lines)  # compacted, more than once
    assert not (p / "extents.idx.tmp").exists()
    nv.close()
    sd.close()
    with SwapDir(p) as sd2:
        nv2, table = NvmeBackend.recover(sd2)
        assert sorted(table) == ["k0", "k1", "k2"]
        for i, k in enumerate(["k0", "k1", "k2"]):
            nv2.read(table[k], b).result()
            assert torch.all(b == 19 * 3 + i)
        nv2.close()


class _SmallDisk:
    """A fake file system with ``free`` bytes: posix_fallocate takes what it can, then fails."""

    def __init__(self, monkeypatch, free: int):
        self.free = free
        monkeypatch.setattr(swapdir_mod.os, "posix_fallocate", self.fallocate)
        monkeypatch.setattr(swapdir_mod.shutil, "disk_usage",
                            lambda p: shutil._ntuple_diskusage(1 << 40, 0, self.free))

    def fallocate(self, fd, off, n):
        grow = n - os.fstat(fd).st_blocks * 512
        if grow > self.free:
            self.free = 0  # like a real file system: the failed attempt keeps what it took
            raise OSError(errno.ENOSPC, "No space left on device")
        self.free -= max(grow, 0)
        os.ftruncate(fd, max(n, os.fstat(fd).st_size))


def test_unbounded_tier_reserves_what_it_needs_not_a_gibibyte(tmp_path, monkeypatch):
    """Found: on a 250 MB disk a 120 MB swap was refused: the tier grew in 1 GiB steps."""
    disk = _SmallDisk(monkeypatch, free=100 * MiB)
    with TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu") as s:
        h = s.register("w", data=torch.ones(MiB))  # 4 MiB of weights
        assert torch.equal(s.load(h), torch.ones(MiB))
        assert s.nvme.capacity <= 4 * MiB + nvme_mod.reserve_margin(4 * MiB)
    assert disk.free > 70 * MiB


def test_a_planned_reservation_that_does_not_fit_names_the_true_free_space(tmp_path, monkeypatch):
    """Found: the refusal said "0.00 GiB free" (measured after the failed fallocate took the space)."""
    _SmallDisk(monkeypatch, free=100 * MiB)
    with pytest.raises(DiskFullError, match=r"has 100.00 MiB free but the NVMe tier \(extents.bin\) needs "
                                            r"118.00 MiB more") as e:
        TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu", nvme_reserve=118 * MiB)
    assert e.value.exit_code == EXIT_DISK_FULL
    assert not (tmp_path / "s").exists()
    disk = _SmallDisk(monkeypatch, free=50 * MiB)  # the check before fallocate: nothing taken
    with pytest.raises(DiskFullError, match="has 50.00 MiB free"):
        TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu", nvme_reserve=118 * MiB)
    assert disk.free == 50 * MiB
    disk = _SmallDisk(monkeypatch, free=120 * MiB)  # fits, with less than the margin to spare
    with TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu", nvme_reserve=118 * MiB) as s:
        assert s.nvme.capacity == 118 * MiB and disk.free == 2 * MiB  # room for the journal


def test_trim_gives_back_the_reservation_past_the_extents(tmp_path):
    """The plan's reservation is a padding bound: once the extents are placed, the file keeps
    them plus ``keep`` and the disk gets the rest back; a later need grows the file again."""
    swap_file = tmp_path / "s" / "extents.bin"
    with TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu", nvme_reserve=40 * MiB) as s:
        h = s.register("w", data=torch.ones(MiB))  # 4 MiB of weights
        assert s.nvme.capacity == 40 * MiB
        s.nvme.trim(keep=MiB)
        assert s.nvme.capacity == 5 * MiB and s.nvme.held == 4 * MiB
        assert swap_file.stat().st_size == 5 * MiB and swap_file.stat().st_blocks * 512 <= 5 * MiB
        s.nvme.trim()
        assert s.nvme.capacity == 4 * MiB
        g = s.register("g", data=torch.full((2 * MiB,), 2.0))  # 8 MiB more: the file grows
        assert s.nvme.capacity >= 12 * MiB
        assert torch.equal(s.load(h), torch.ones(MiB)) and torch.equal(s.load(g), torch.full((2 * MiB,), 2.0))


def test_swap_files_are_private(tmp_path):
    with TieredStore(MiB, MiB, swap_dir=tmp_path / "s", device="cpu") as s:
        s.register("w", data=torch.ones(10))
        for f in (tmp_path / "s").iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_swap_dir_others_can_tamper_with_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:  # pretend to be someone else: then the directory (and the link) are another user's
        monkeypatch.setattr(swapdir_mod.os, "geteuid", lambda: os.getuid() + 1)
    (tmp_path / "link").symlink_to(theirs)
    with pytest.raises(SwapDirError, match=r"link is a symlink to a directory owned by another user"):
        SwapDir(tmp_path / "link")
    monkeypatch.undo()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(SwapDirError, match="writable by every user without the sticky bit"):
        SwapDir(shared / "swap")
    os.chmod(shared, 0o1777)  # like /tmp: others cannot remove or rename our files
    with SwapDir(shared / "swap"):
        pass


def test_a_killed_runs_swap_dir_is_removed_by_the_next_run_but_never_user_files(tmp_path):
    left = tmp_path / "left"
    left.mkdir()
    (left / LOCK_NAME).write_text("12345\n")  # a killed run's: its lock file, no lock held
    (left / DATA_FILE).write_bytes(b"x" * 4096)
    with TieredStore(MiB, MiB, swap_dir=left, device="cpu") as s:
        s.register("w", data=torch.ones(10))
    assert not left.exists()
    (left).mkdir()
    (left / LOCK_NAME).write_text("12345\n")
    (left / "notes.txt").write_text("the user's")
    with SwapDir(left):
        pass
    assert (left / "notes.txt").read_text() == "the user's"
