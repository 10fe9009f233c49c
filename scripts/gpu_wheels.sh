#!/usr/bin/env bash
# Fill .whl/ with what the GPU proof (scripts/gpu_proof.sh) needs and the GPU image lacks, for
# CPython 3.12 on manylinux x86_64; run it where the package index is reachable (the GPU machine
# has no internet). .whl/ is ignored by git and travels with the working tree.
#
#   bash scripts/gpu_wheels.sh [--dest DIR] [--limit-mib N] [--no-bitsandbytes]
#
# What the image has is its package list (the device notes' KINDS.md: torch 2.11, triton,
# transformers, peft, accelerate, einops, msgpack, ninja, psutil, py-cpuinfo, tqdm, ...). Carried:
#   torchao        0.18.0: the first release built against torch 2.11 (it loads its C++ ops only
#                  on torch >= 2.11); torchao.optim.CPUOffloadOptimizer is pure Python
#   deepspeed      0.19.8: on PyPI as an sdist only, built here into a pure wheel (DS_BUILD_OPS=0);
#                  its cpu_adam and async_io ops JIT-build on the GPU machine (ninja, gcc, nvcc there)
#   deepspeed's needs the image lacks: hjson, pydantic + pydantic-core (a cp312 binary),
#                  annotated-types, typing-inspection, and typing-extensions (pydantic wants >= 4.14)
#   bitsandbytes   0.50.2 (QLoRA: offload/engine/nf4.py and its tests), 41 MiB: dropped, with a line
#                  saying so, when it would take the total over --limit-mib
#   deb/           libaio's library and header for DeepSpeed's async_io op (ZeRO-Infinity), from
#                  this machine's apt; gpu_proof.sh unpacks them under /tmp if the image has none
# gguf is not carried: outcore imports it only to read or write GGUF files, which no stage does.
# The total must stay <= --limit-mib (50): the working tree that travels is 64 MiB at most.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl LIMIT_MIB=50 BNB=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) DEST=${2:?}; shift ;;
    --limit-mib) LIMIT_MIB=${2:?}; shift ;;
    --no-bitsandbytes) BNB=0 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

TORCHAO=torchao==0.18.0
DEEPSPEED=deepspeed==0.19.8
NEEDS=(hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
       typing-extensions==4.16.0)
BITSANDBYTES=bitsandbytes==0.50.2
# pip matches manylinux_2_N exactly: name every N the wheels above are tagged with
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

download() {  # download SPEC...: binary wheels for cp312 manylinux x86_64, without their dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
  for spec in "$@"; do  # pip's exit status is lost in the pipe: check every file came
    name=${spec%%==*} version=${spec#*==}
    ls "$DEST/${name//-/_}-$version"-*.whl > /dev/null 2>&1 || { echo "gpu_wheels.sh: no wheel for $spec" >&2; exit 1; }
  done
}
size() { du -cb "$@" 2> /dev/null | tail -1 | cut -f1; }

rm -rf "$DEST"
mkdir -p "$DEST/deb"
download "$TORCHAO" "${NEEDS[@]}"

# DeepSpeed: its sdist's setup.py imports torch, so the build uses this machine's torch
# (--no-build-isolation) and builds no op (DS_BUILD_OPS=0): a py3-none-any wheel whose ops JIT-build
# where they run. It records this machine's torch and accelerator for prebuilt ops only; it has none.
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed -w "$BUILD" "$DEEPSPEED" \
  2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
cp "$BUILD"/deepspeed-*-py3-none-any.whl "$DEST"/ || { echo "gpu_wheels.sh: the deepspeed wheel did not build" >&2; exit 1; }

# libaio for DeepSpeed's async_io (Debian/Ubuntu name it libaio1, or libaio1t64 since 2024)
if command -v apt-get > /dev/null; then
  (cd "$DEST/deb" && { apt-get download -q libaio1t64 2> /dev/null || apt-get download -q libaio1; } \
     && apt-get download -q libaio-dev) > /dev/null 2>&1 \
    || echo "gpu_wheels.sh: could not download libaio's .debs (apt-get update first?): ZeRO-Infinity then needs the image's libaio" >&2
fi
rmdir "$DEST/deb" 2> /dev/null || true

LIMIT=$((LIMIT_MIB * 1024 * 1024))
if [ $BNB = 1 ]; then
  download "$BITSANDBYTES"
  if [ "$(size "$DEST")" -gt $LIMIT ]; then
    rm -f "$DEST"/bitsandbytes-*.whl
    echo "gpu_wheels.sh: bitsandbytes left out: it would take .whl/ over ${LIMIT_MIB} MiB (QLoRA tests will fail there)" >&2
  fi
fi

# Every carried wheel's requirements (extras and other platforms aside) must be carried or on the
# image: checked against the image's package list where this machine has the device notes.
KINDS=${GPU_IMAGE_PACKAGES:-/work/.library/device/KINDS.md}
python3 - "$DEST" "$KINDS" <<'EOF'
import re, sys, zipfile
from pathlib import Path
from packaging.markers import default_environment
from packaging.requirements import Requirement
dest, kinds = Path(sys.argv[1]), Path(sys.argv[2])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
carried = {norm(w.name.split("-")[0]) for w in dest.glob("*.whl")}
image = set()
if kinds.exists():
    m = re.search(r"Packages: (.+?)\.\s*$", kinds.read_text(), re.M)
    image = {norm(x.strip()) for x in m.group(1).split(",")} if m else set()
unmet = {}
for w in sorted(dest.glob("*.whl")):
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                if norm(req.name) not in carried | image:
                    unmet.setdefault(norm(req.name), []).append(w.name.split("-")[0])
if not image:
    print(f"gpu_wheels.sh: {kinds} not found: requirements not checked against the image: "
          + (", ".join(sorted(unmet)) or "none"), file=sys.stderr)
elif unmet:
    sys.exit("gpu_wheels.sh: needed, neither carried nor on the image: "
             + ", ".join(f"{n} (by {', '.join(by)})" for n, by in sorted(unmet.items())))
EOF

TOTAL=$(size "$DEST")
echo "$DEST (cp312 manylinux x86_64):"
(cd "$DEST" && find . -type f -printf '%s %P\n' | sort -k2 | awk '{printf "  %8.2f MiB  %s\n", $1 / 1048576, $2}')
awk -v t="$TOTAL" -v l="$LIMIT_MIB" 'BEGIN {printf "  %8.2f MiB  total (limit %s MiB)\n", t / 1048576, l}'
if [ "$TOTAL" -gt $LIMIT ]; then
  echo "gpu_wheels.sh: $DEST holds $TOTAL bytes, over the ${LIMIT_MIB} MiB limit" >&2
  exit 1
fi
