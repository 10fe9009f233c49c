"""The CPU 8-bit AdamW kernel alone, per ISA level: ns per element on one thread.

A stand-alone build of ``kernels/csrc/adamw8bit_cpu.cpp`` (``-DOUTCORE_KERNEL_ONLY``: no torch,
no threads) with each level's flags (``kernels/cpu_ext.py: _ISA_FLAGS``), timing the full
blocks of one tensor updated in place, repeatedly: ``--numel`` 65536 keeps it in cache (the
kernel's own cost), 16M reads it from DRAM. Times are the thread's CPU time (the best of
``--repeats``), so a descheduled thread on a shared machine does not count; neighbours'
cache and memory traffic still do: report the load (``loadavg``). The codes' checksum is
printed per level and state format: every level must give the same (the tests prove bit-identity to the
reference; this shows the timed run computes it).

    python scripts/bench_adamw8bit_cpu.py [--isa AVX2,AVX512_VBMI] [--numel N] [--repeats N] [--lean]
                                          [--formats dynamic,fp8] [--json]

``--lean`` times the bf16-lean form (bf16 weights and gradients widened, updated and rounded
back stochastically block by block: ``LeanParams``). ``--formats`` the state formats
(``kernels/adamw8bit.py: STATE_FORMATS``), each timed at every level.

Needs g++ (or ``$CXX``). Levels above the CPU's are refused.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DRIVER = r"""
#define OUTCORE_KERNEL_ONLY 1
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>
#include "adamw8bit_cpu.cpp"
template <class T> static std::vector<T> rd(const std::string& dir, int i, size_t n) {
  std::vector<T> v(n);
  FILE* f = std::fopen((dir + "/t" + std::to_string(i) + ".bin").c_str(), "rb");
  if (!f || std::fread(v.data(), sizeof(T), n, f) != n) { std::fprintf(stderr, "bad table %d\n", i); std::exit(2); }
  std::fclose(f);
  return v;
}
static double cpu_now() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  const std::string dir = argv[1];
  const int64_t n = std::atoll(argv[2]) / kBlock * kBlock;
  const int reps = std::atoi(argv[3]);
  const bool lean = std::atoi(argv[4]) != 0;
  const Format fmt = static_cast<Format>(std::atoi(argv[5]));
  auto qm = rd<float>(dir, 0, 256), qv = rd<float>(dir, 1, 256);
  auto tm = rd<float>(dir, 3, 256), tv = rd<float>(dir, 5, 256);
  auto bm = rd<uint8_t>(dir, 2, kTableBytes), bv = rd<uint8_t>(dir, 4, kTableBytes);
  auto sm = rd<float>(dir, 6, kSegRows * kSegCols), sv = rd<float>(dir, 7, kSegRows * kSegCols);
  const Maps maps{qm.data(), qv.data(), bm.data(), tm.data(), bv.data(), tv.data(), sm.data(), sv.data()};
  const Tables tables(maps);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> p(n), g(n), ma(n / kBlock, 0.f), va(n / kBlock, 0.f);
  std::vector<uint8_t> mc(n, fmt == Format::kFp8 ? 0 : 127), vc(n, 0);  // the formats' zero codes
  for (int64_t i = 0; i < n; ++i) { p[i] = nd(rng) * 0.02f; g[i] = nd(rng) * 1e-3f; }
  std::vector<uint16_t> p16(n), g16(n);  // bf16-lean: the values' top halves
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &p[i], 4); p16[i] = static_cast<uint16_t>(u >> 16);
    std::memcpy(&u, &g[i], 4); g16[i] = static_cast<uint16_t>(u >> 16);
  }
  const LeanTensor lt{p16.data(), g16.data(), 12345u, 678u, 0};
  // a step-10 bias correction and some weight decay, read at run time: constants of 1 would let
  // the compiler drop two multiplies the real update does
  volatile float ibc2 = 6.4f, decay = 0.99999f;
  const Coeffs c{0.9f, 0.1f, 0.999f, 0.001f, ibc2, 1e-8f, 1e-4f, decay};
  double best = 1e30;
  for (int r = 0; r < reps + 3; ++r) {  // 3 warm-up updates: the moments leave their zero codes
    const double t0 = cpu_now();
    if (lean) {
      LeanParams io(lt);
      update_range(io, mc.data(), ma.data(), vc.data(), va.data(), maps, tables, n, 0, n / kBlock, c, fmt);
    } else {
      Fp32Params io{p.data(), g.data()};
      update_range(io, mc.data(), ma.data(), vc.data(), va.data(), maps, tables, n, 0, n / kBlock, c, fmt);
    }
    if (r >= 3) best = std::min(best, cpu_now() - t0);
  }
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < n; ++i) h = ((h ^ mc[i]) * 1099511628211ull ^ vc[i]) * 1099511628211ull;
  if (lean) for (int64_t i = 0; i < n; ++i) h = (h ^ p16[i]) * 1099511628211ull;
  std::printf("%.6f %016llx\n", best / n * 1e9, static_cast<unsigned long long>(h));
}
"""


def main(argv: list[str] | None = None) -> int:
    from outcore.kernels.adamw8bit import STATE_FORMATS, _cpu_tables
    from outcore.kernels.cpu_ext import _ISA_FLAGS, supported_isa_levels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="", help="comma-separated levels (default: every level this CPU runs)")
    ap.add_argument("--numel", type=int, default=65536, help="elements updated per call (whole blocks)")
    ap.add_argument("--repeats", type=int, default=300, help="timed updates; the best counts")
    ap.add_argument("--lean", action="store_true",
                    help="the bf16-lean update (bf16 weights and gradients, stochastic rounding)")
    ap.add_argument("--formats", default="dynamic",
                    help=f"comma-separated state formats (of {','.join(STATE_FORMATS)}; default: dynamic)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or not set(formats) <= set(STATE_FORMATS):
        ap.error(f"--formats {args.formats!r}: choose from {','.join(STATE_FORMATS)}")
    supported = supported_isa_levels()
    levels = [lv.strip().upper() for lv in args.isa.split(",") if lv.strip()] or list(supported)
    bad = [lv for lv in levels if lv not in supported]
    if bad:
        ap.error(f"--isa {','.join(bad)}: this CPU runs {', '.join(supported)}")
    csrc = Path(__file__).resolve().parent.parent / "kernels" / "csrc"
    cxx = os.environ.get("CXX", "g++")
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, t in enumerate(_cpu_tables()):
            t.numpy().tofile(f"{tmp}/t{i}.bin")
        (Path(tmp) / "driver.cpp").write_text(DRIVER)
        for lv in levels:
            exe = f"{tmp}/bench_{lv.lower()}"
            subprocess.run([cxx, "-O3", "-ffp-contract=off", "-fno-math-errno", *_ISA_FLAGS[lv],
                            f"-I{csrc}", f"{tmp}/driver.cpp", "-o", exe], check=True)
            result[lv] = {}
            for fmt in formats:
                out = subprocess.run([exe, tmp, str(args.numel), str(args.repeats), str(int(args.lean)),
                                      str(STATE_FORMATS.index(fmt))],
                                     check=True, stdout=subprocess.PIPE, text=True).stdout.split()
                result[lv][fmt] = {"ns_per_element": float(out[0]), "codes_checksum": out[1]}
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    result["_meta"] = {"cpu_model": model, "isa_supported": list(supported), "numel": args.numel,
                       "repeats": args.repeats, "lean": args.lean, "threads": 1, "loadavg": list(os.getloadavg()),
                       "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for lv in levels:
            forced = "" if lv == supported[-1] else " (below this CPU's best: forced)"
            for fmt, r in result[lv].items():
                print(f"{lv:<12}{fmt:<8}{r['ns_per_element']:.3f} ns/element  codes {r['codes_checksum']}{forced}")
        print(f"{model}, {args.numel} elements{' (bf16-lean)' if args.lean else ''}, one thread, "
              f"best of {args.repeats}; "
              f"load {result['_meta']['loadavg'][0]:.1f}")
    same = all(len({result[lv][fmt]["codes_checksum"] for lv in levels}) == 1 for fmt in formats)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
