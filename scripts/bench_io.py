"""Sequential NVMe throughput: outcore's I/O engine against fio (or dd) on the same directory.

For each tensor size (1–64 MiB) the engine writes ``--total-mib`` of tensors as
checksummed extents through ``NvmeBackend`` (O_DIRECT, the store's thread pool
and queue depth) and reads them back, verifying every checksum. In the same
run, interleaved repeat by repeat, ``fio`` (1 MiB blocks, O_DIRECT, the same
queue depth; ``dd`` with ``oflag/iflag=direct`` when fio is absent) writes and
reads the same amount in the same directory. ``/proc/self/io`` proves the
engine's bytes reached the block layer (not the page cache). The cost of the
xxh3 checksums is measured separately (hash throughput, and the engine with
checksums against the bare thread pool).

    python scripts/bench_io.py --quick            # a few seconds
    python scripts/bench_io.py --dir /nvme/swap --json

Figures are medians over ``--repeats`` after a warm-up; GB/s = 1e9 bytes/s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash

from outcore.offload.aligned import aligned_empty
from outcore.offload.store import NvmeBackend, SwapDir
from outcore.offload.store.directio import IOPool, open_direct
from outcore.cli.jsonout import emit_json, json_stdout

MiB = 1 << 20


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (all threads)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


_SRC: list[torch.Tensor] = []


def _source(nbytes: int) -> torch.Tensor:
    """An aligned buffer of random bytes, made once and shared by every round (a slice of it)."""
    if not _SRC or _SRC[0].numel() < nbytes:
        buf = aligned_empty(nbytes)
        buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
        _SRC[:] = [buf]
    return _SRC[0][:nbytes]


def engine_round(directory: Path, size: int, total: int, qd: int, chunk: int) -> dict:
    """Write then read ``total`` bytes as ``size``-byte checksummed extents; GB/s and block-layer bytes."""
    n = max(1, total // size)
    sd = SwapDir(directory / f"engine-{size}")
    nv = NvmeBackend(sd, capacity=n * size, pool=IOPool(qd, chunk))
    nv._own_pool = True
    try:
        src = _source(max(2 * size, min(n * size, 256 * MiB)))
        bufs = [src[i * size:(i + 1) * size] for i in range(src.numel() // size)]
        exts = [nv.alloc(f"t{i}", size) for i in range(n)]
        io0 = proc_io()
        t0 = time.perf_counter()
        futs = [nv.write(e, bufs[i % len(bufs)]) for i, e in enumerate(exts)]
        for f in futs:
            f.result()
        t_w = time.perf_counter() - t0
        io1 = proc_io()
        futs = []
        t0 = time.perf_counter()
        # Reads into a rotating set of buffers: a buffer is reused only after its read landed.
        for i, e in enumerate(exts):
            if i >= len(bufs):
                futs[i - len(bufs)].result()
            futs.append(nv.read(e, bufs[i % len(bufs)]))
        for f in futs:
            f.result()
        t_r = time.perf_counter() - t0
        io2 = proc_io()
    finally:
        nv.close()
        sd.close()
    nbytes = n * size
    return {"write_gbps": nbytes / t_w / 1e9, "read_gbps": nbytes / t_r / 1e9, "bytes": nbytes,
            "disk_write_bytes": io1["write_bytes"] - io0["write_bytes"],
            "disk_read_bytes": io2["read_bytes"] - io1["read_bytes"], "o_direct": nv.direct}


def raw_pool_round(directory: Path, size: int, total: int, qd: int, chunk: int) -> dict:
    """The bare thread pool (no checksums, no journal): what the checksums cost is the difference."""
    n = max(1, total // size)
    path = directory / "raw.bin"
    fd, _ = open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    pool = IOPool(qd, chunk)
    try:
        os.posix_fallocate(fd, 0, n * size)
        buf = _source(size)
        t0 = time.perf_counter()
        for f in [pool.write(fd, buf, i * size) for i in range(n)]:
            f.result()
        t_w = time.perf_counter() - t0
        t0 = time.perf_counter()
        futs = [pool.read(fd, buf, i * size) for i in range(n)]  # same buffer: bytes are not checked here
        for f in futs:
            f.result()
        t_r = time.perf_counter() - t0
    finally:
        pool.close()
        os.close(fd)
        path.unlink()
    return {"write_gbps": n * size / t_w / 1e9, "read_gbps": n * size / t_r / 1e9}


def fio_round(directory: Path, total: int, qd: int) -> dict:
    """fio sequential write then read, 1 MiB blocks, O_DIRECT, queue depth ``qd``."""
    path = directory / "fio.bin"
    out = {}
    for rw in ("write", "read"):
        cmd = ["fio", f"--name=seq{rw}", f"--filename={path}", f"--size={total}", "--bs=1M", "--direct=1",
               f"--rw={rw}", "--ioengine=libaio", f"--iodepth={qd}", "--numjobs=1", "--output-format=json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:  # no libaio: synchronous engine, one request at a time
            cmd[cmd.index("--ioengine=libaio")] = "--ioengine=psync"
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
        out[f"{rw}_gbps"] = job[rw]["bw_bytes"] / 1e9
    path.unlink()
    return out


def dd_round(directory: Path, total: int) -> dict:
    """dd with O_DIRECT (1 MiB blocks): write (fdatasync at the end) then read."""
    path, count = directory / "dd.bin", max(1, total // MiB)

    def run(args) -> float:
        r = subprocess.run(["dd", *args, "bs=1M", f"count={count}"], capture_output=True, text=True, check=True)
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
        return int(m.group(1)) / float(m.group(2)) / 1e9
    w = run(["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fdatasync"])
    r = run([f"if={path}", "of=/dev/null", "iflag=direct"])
    path.unlink()
    return {"write_gbps": w, "read_gbps": r}


def dd_concurrent_round(directory: Path, total: int) -> dict:
    """One dd reading a file while another writes one (O_DIRECT, 1 MiB blocks, ``total`` bytes each).

    Whether the disk serves a read and a write at once at their separate speeds (then a
    step's disk time is the longer of its reads and writes) or shares one bandwidth
    between them (the sum) is this round's time against :func:`dd_round`'s two.

    Returns:
        ``{"seconds", "read_bytes", "write_bytes"}``: wall time until both finished.
    """
    src, dst, count = directory / "dd-src.bin", directory / "dd-dst.bin", max(1, total // MiB)
    dd = ["dd", "bs=1M", f"count={count}"]
    subprocess.run([*dd, "if=/dev/zero", f"of={src}", "oflag=direct", "conv=fdatasync"], capture_output=True,
                   check=True)
    try:
        t0 = time.perf_counter()
        procs = [subprocess.Popen([*dd, f"if={src}", "of=/dev/null", "iflag=direct"], stderr=subprocess.DEVNULL),
                 subprocess.Popen([*dd, "if=/dev/zero", f"of={dst}", "oflag=direct", "conv=fdatasync"],
                                  stderr=subprocess.DEVNULL)]
        codes = [p.wait() for p in procs]
        seconds = time.perf_counter() - t0
        if any(codes):
            raise subprocess.CalledProcessError(max(codes), "dd")
    finally:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
    return {"seconds": seconds, "read_bytes": count * MiB, "write_bytes": count * MiB}


def checksum_gbps(nbytes: int = 64 * MiB, reps: int = 5) -> float:
    """Single-thread xxh3-64 throughput (GB/s) over a buffer of ``nbytes``."""
    buf = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    xxhash.xxh3_64_intdigest(buf)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(buf)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: ./.bench_io, removed)")
    ap.add_argument("--sizes-mib", default="1,4,16,64", help="tensor sizes in MiB")
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes written and read per measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--queue-depth", type=int, default=8, help="engine threads = fio iodepth")
    ap.add_argument("--chunk-mib", type=int, default=8, help="engine syscall size (fio uses 1 MiB blocks)")
    ap.add_argument("--headline-mib", type=int, default=None, help="size quoted as engine_*_gbps (default: largest)")
    ap.add_argument("--baseline", choices=["auto", "fio", "dd"], default="auto")
    ap.add_argument("--quick", action="store_true", help="256 MiB, sizes 1,64, 3 repeats")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    if a.quick:
        a.sizes_mib, a.total_mib, a.repeats = "1,64", 256, 3
    sizes = [int(s) * MiB for s in a.sizes_mib.split(",")]
    headline = (a.headline_mib * MiB) if a.headline_mib else max(sizes)
    if headline not in sizes:
        ap.error(f"--headline-mib {a.headline_mib} is not one of --sizes-mib {a.sizes_mib}")
    total, chunk = a.total_mib * MiB, a.chunk_mib * MiB
    tool = a.baseline if a.baseline != "auto" else ("fio" if shutil.which("fio") else "dd")
    base = Path(a.dir or ".bench_io").absolute()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=base))
    torch.set_num_threads(os.cpu_count() or 1)

    eng: dict[int, list[dict]] = {s: [] for s in sizes}
    raw, bl = [], []
    try:
        engine_round(work, sizes[-1], min(total, 128 * MiB), a.queue_depth, chunk)  # warm-up
        for _ in range(a.repeats):  # interleaved: engine sizes, bare pool, baseline
            for s in sizes:
                eng[s].append(engine_round(work, s, total, a.queue_depth, chunk))
            raw.append(raw_pool_round(work, headline, total, a.queue_depth, chunk))
            bl.append(fio_round(work, total, a.queue_depth) if tool == "fio" else dd_round(work, total))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    rng = lambda rows, k: [min(r[k] for r in rows), max(r[k] for r in rows)]  # noqa: E731
    h = eng[headline]
    res = {
        "engine_read_gbps": med(h, "read_gbps"), "engine_write_gbps": med(h, "write_gbps"),
        "baseline_read_gbps": med(bl, "read_gbps"), "baseline_write_gbps": med(bl, "write_gbps"),
        "baseline_tool": tool if tool == "dd" else f"fio (libaio, iodepth {a.queue_depth}, bs 1M, direct)",
        "headline_tensor_mib": headline // MiB,
        "engine_by_size": {str(s // MiB): {"read_gbps": med(eng[s], "read_gbps"),
                                           "write_gbps": med(eng[s], "write_gbps"),
                                           "read_min_max": rng(eng[s], "read_gbps"),
                                           "write_min_max": rng(eng[s], "write_gbps")} for s in sizes},
        "baseline_read_min_max": rng(bl, "read_gbps"), "baseline_write_min_max": rng(bl, "write_gbps"),
        "engine_raw_read_gbps": med(raw, "read_gbps"), "engine_raw_write_gbps": med(raw, "write_gbps"),
        "checksum_xxh3_gbps": checksum_gbps(),
        "o_direct": h[0]["o_direct"],
        "disk_read_bytes_per_byte": med(h, "disk_read_bytes") / h[0]["bytes"],
        "disk_write_bytes_per_byte": med(h, "disk_write_bytes") / h[0]["bytes"],
        "total_mib": a.total_mib, "repeats": a.repeats, "queue_depth": a.queue_depth, "chunk_mib": a.chunk_mib,
        "dir": str(base), "cpu_threads": os.cpu_count(),
    }
    res["read_ratio"] = res["engine_read_gbps"] / res["baseline_read_gbps"]
    res["write_ratio"] = res["engine_write_gbps"] / res["baseline_write_gbps"]
    res["checksum_cost_read"] = 1 - res["engine_read_gbps"] / res["engine_raw_read_gbps"]
    res["checksum_cost_write"] = 1 - res["engine_write_gbps"] / res["engine_raw_write_gbps"]
    if a.json:
        emit_json(json.dumps(res))
    else:
        print(f"dir {base}  total {a.total_mib} MiB  qd {a.queue_depth}  repeats {a.repeats}  "
              f"O_DIRECT {res['o_direct']}  (medians, GB/s)")
        print(f"{'what':28s} {'read':>7s} {'write':>7s}")
        for s in sizes:
            e = res["engine_by_size"][str(s // MiB)]
            print(f"{'engine ' + str(s // MiB) + ' MiB tensors':28s} {e['read_gbps']:7.2f} {e['write_gbps']:7.2f}")
        print(f"{'bare pool (no checksums)':28s} {res['engine_raw_read_gbps']:7.2f} "
              f"{res['engine_raw_write_gbps']:7.2f}")
        print(f"{res['baseline_tool'][:28]:28s} {res['baseline_read_gbps']:7.2f} {res['baseline_write_gbps']:7.2f}")
        print(f"ratio engine/baseline: read {res['read_ratio']:.2f}  write {res['write_ratio']:.2f}")
        print(f"xxh3 {res['checksum_xxh3_gbps']:.1f} GB/s/thread; checksum cost read {res['checksum_cost_read']:+.1%}, "
              f"write {res['checksum_cost_write']:+.1%}")
        print(f"block-layer bytes per engine byte: read {res['disk_read_bytes_per_byte']:.2f}, "
              f"write {res['disk_write_bytes_per_byte']:.2f}")
    return res


if __name__ == "__main__":
    with json_stdout("--json" in sys.argv[1:]):  # stdout: the JSON document alone
        main(sys.argv[1:])
