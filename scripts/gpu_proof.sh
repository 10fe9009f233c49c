#!/usr/bin/env bash
# The GPU proof in one command: on a bare GPU machine with no internet, run every check of
# outcore's GPU path, one JSON file per stage, each written as the stage ends (docs/gpu_proof.md).
#
#   bash scripts/gpu_proof.sh [--dry-run] [--out DIR] [--device auto|cuda|sim|cpu]
#
# First, where the package index is reachable: `bash scripts/gpu_wheels.sh` fills .whl/ with the
# wheels the GPU image lacks (torchao, deepspeed and its pure-Python needs, bitsandbytes, libaio);
# .whl/ travels with the working tree. Never run scripts/setup.sh on the GPU machine: it would
# reach for the index and could replace the image's torch.
#
# Output: --out DIR, else $OUT (the device tool's folder), else runs/gpu_proof. The device tool
# returns at most 8 files from $OUT, so when the output is $OUT the stage files go to a scratch
# folder and $OUT gets summary.json (every stage's JSON inside) and gpu_proof.tar.gz (all files),
# both refreshed as each stage ends.
#
# Time: at most PROOF_BUDGET_S (480 s; 600 s with --dry-run) from start to summary. Every stage
# has its own timeout (below; PROOF_B_<STAGE> overrides one), clipped to what is left; a stage that
# times out keeps what it had finished. PROOF_PEERS picks the peers and their order, PROOF_SEQ and
# PROOF_BATCH the tokens of the step bench and the peers, PROOF_NVME_DIR ZeRO-Infinity's swap (/tmp).
# --dry-run runs every stage on the simulated accelerator (the CPU until outcore.offload.simdevice
# exists) at tiny shapes: CI tests this script that way (tests/packaging/test_gpu_proof.py).
set -uo pipefail  # no -e: a failing stage is recorded in its JSON, never fatal to the others

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DRY=0 OUTDIR="" DEV=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUTDIR=${2:?--out needs a folder}; shift ;;
    --out=*) OUTDIR=${1#--out=} ;;
    --device) DEV=${2:?--device needs auto, cuda, sim or cpu}; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_proof.sh: unknown argument '$1' (--dry-run, --out DIR, --device D)" >&2; exit 2 ;;
  esac
  shift
done
DEV=${DEV:-$([ $DRY = 1 ] && echo sim || echo cuda)}
PUBLISH=""
if [ -z "$OUTDIR" ] && [ -n "${OUT:-}" ]; then  # the device tool's $OUT: compact output
  PUBLISH=$OUT
  WORK=$(mktemp -d /tmp/gpu_proof.XXXXXX)
else
  WORK=${OUTDIR:-runs/gpu_proof}
fi
mkdir -p "$WORK/logs" || exit 2
WORK=$(cd "$WORK" && pwd)
rm -f "$WORK"/*.json "$WORK"/*.xml "$WORK"/*.part "$WORK"/stages.jsonl "$WORK"/logs/*.log

# --- the clock and the stage budgets (seconds) ---------------------------------------------
START=$(date +%s)
if [ $DRY = 1 ]; then
  # (on a 2-core CI machine whose other core runs another test worker, ~210 s in all (2026-12-02):
  # the tests stage mostly imports and collects)
  TOTAL=${PROOF_BUDGET_S:-600}
  B_SETUP=45 B_ENV=45 B_DSOPS=120 B_TESTS=180 B_KERNELS=100 B_STEP=60 B_LONG=60 B_PEERS=90 B_PEERS8=45 B_RACE=70
  DRYFLAG=(--dry-run) PEERS8=(--peers plain)  # the second peers stage only checks the stage runs
else
  TOTAL=${PROOF_BUDGET_S:-480}
  # Sized from the runs on an H200 (2026-11-26): setup and env ~15 s, the tests 60, the kernels 35,
  # a 1.7B step ~60 (20 of them initializing the weights), two short race runs ~25 each.
  # DeepSpeed's ops build in the background during the tests and kernels (they need the CPU little).
  # The long-context stage (8B, 2 blocks, at the longest context the plan finds under the 24 GiB cap,
  # ~91K tokens: weight init, the plan, a warm-up and a timed step of ~4 s each) takes its 60 s from
  # the peers'.
  B_SETUP=30 B_ENV=15 B_DSOPS=240 B_TESTS=75 B_KERNELS=40 B_STEP=70 B_LONG=60 B_PEERS=60 B_PEERS8=30 B_RACE=60
  DRYFLAG=() PEERS8=()
fi
# Any budget can be set from the environment (a longer lease: PROOF_BUDGET_S=900 PROOF_B_PEERS=300 ...)
for b in SETUP ENV DSOPS TESTS KERNELS STEP LONG PEERS PEERS8 RACE; do
  v=PROOF_B_$b; [ -n "${!v:-}" ] && printf -v "B_$b" '%s' "${!v}"
done
PEERS=(${PROOF_PEERS:+--peers "$PROOF_PEERS"})  # the peers and their order (bench_peers.py --peers)
[ ${#PEERS8[@]} = 0 ] && PEERS8=("${PEERS[@]}")
DEADLINE=$((START + TOTAL))
SEQ=${PROOF_SEQ:-1024} BATCH=${PROOF_BATCH:-2}  # the step bench and the peers train the same tokens

now() { date +%s; }
left() { echo $((DEADLINE - $(now) - 5)); }  # 5 s kept for the summary
clip() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
BOOKS=(--work "$WORK" --device "$DEV" --budget "$TOTAL")
[ $DRY = 1 ] && BOOKS+=(--dry-run)
[ -n "$PUBLISH" ] && BOOKS+=(--publish "$PUBLISH")

finish() {  # finish NAME FILE RC SECONDS [REASON]: the books, the one-line summary, the compact copy
  python3 scripts/_gpu_proof.py finish --name "$1" --file "$2" --rc "$3" --seconds "$4" \
    --reason "${5:-}" --elapsed $(($(now) - START)) "${BOOKS[@]}"
}

run_stage() {  # run_stage NAME FILE BUDGET CMD...: CMD's stdout is the stage's JSON
  local name=$1 file=$2 t s rc
  t=$(clip "$3"); shift 3
  if [ "$t" -lt 5 ]; then
    finish "$name" "$file" 125 0 "the proof's ${TOTAL} s budget was spent before this stage"
    return
  fi
  s=$(now)
  # SIGINT first: the tools catch it and print what they finished; SIGKILL 15 s later
  timeout -s INT -k 15 "$t" "$@" > "$WORK/$file.part" 2> "$WORK/logs/$name.log"
  rc=$?
  mv "$WORK/$file.part" "$WORK/$file"
  finish "$name" "$file" "$rc" $(($(now) - s))
}

clear_locks() {  # a build killed at a stage's timeout leaves a lock the next loader would wait on forever
  (cd scripts && python3 -c 'import sys; from bench_peers import clear_build_locks as c; c(tuple(sys.argv[1:]))' "$@")
}

run_step_bench() {  # the lead's scripts/bench_gpu_step.py, where it exists (BUDGET, SEQ, BATCH: the stage's)
  local name=$1 file=$2; shift 2
  if [ -f scripts/bench_gpu_step.py ]; then
    run_stage "$name" "$file" "${BUDGET:-$B_STEP}" python3 scripts/bench_gpu_step.py --device "$DEV" "$@" \
      --seq "${STAGE_SEQ:-$SEQ}" --batch "${STAGE_BATCH:-$BATCH}" "${DRYFLAG[@]}" --json
  else
    echo '{"status": "missing", "reason": "scripts/bench_gpu_step.py is not in this tree"}' > "$WORK/$file"
    finish "$name" "$file" 0 0
  fi
}

echo "[gpu_proof] output $WORK${PUBLISH:+ (compact copy in $PUBLISH)}; device $DEV; budget ${TOTAL} s$([ $DRY = 1 ] && echo ', dry run')"

# --- setup: carried wheels, libaio, outcore itself (offline) --------------------------------
s=$(now)
SETUP_LOG="$WORK/logs/setup.log"
SITE=${PROOF_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1
if ! ls .whl/*.whl > /dev/null 2>&1; then
  WHEELS="none in .whl/ (run scripts/gpu_wheels.sh where the package index is reachable)"
elif ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  WHEELS="not installed: the wheels are for CPython 3.12, this is $(python3 -V 2>&1)"
elif timeout "$(clip $B_SETUP)" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl/*.whl >> "$SETUP_LOG" 2>&1; then
  rm -rf "$SITE/test"  # torchao's wheel ships its tests as a top-level `test`: it would shadow the stdlib's
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  WHEELS="installed into $SITE: $(cd .whl && ls *.whl | tr '\n' ' ')"
else
  WHEELS="pip install failed (logs/setup.log)"
fi
# DeepSpeed's async_io op needs libaio's header and library; .whl/deb carries them where the
# image has none. Unpacked under /tmp (never /) and pointed to: CFLAGS/LDFLAGS for DeepSpeed's
# compatibility probe, CPATH/LIBRARY_PATH for the build, LD_LIBRARY_PATH for the load.
LIBAIO="system"
if [ ! -e /usr/include/libaio.h ]; then
  LIBAIO="absent"
  if ls .whl/deb/*.deb > /dev/null 2>&1 && command -v dpkg > /dev/null; then
    AIO=/tmp/libaio && mkdir -p $AIO && for d in .whl/deb/*.deb; do dpkg -x "$d" $AIO; done
    AIOLIB=$(dirname "$(find $AIO -name 'libaio.so*' | head -1)")
    export CFLAGS="-I$AIO/usr/include ${CFLAGS:-}" LDFLAGS="-L$AIOLIB ${LDFLAGS:-}"
    export CPATH="$AIO/usr/include${CPATH:+:$CPATH}" LIBRARY_PATH="$AIOLIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$AIOLIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PROOF_LIBAIO_PREFIX=$AIO
    LIBAIO="carried: unpacked from .whl/deb into $AIO"
  fi
fi
# outcore: an editable install against the image's torch, offline; a dry run never installs
# (CI and developers have it already) but imports this tree through a link on PYTHONPATH
if python3 -c "import outcore, os, sys; sys.exit(os.path.realpath(outcore.__path__[0]) != os.path.realpath('$ROOT'))" 2>/dev/null; then
  OUTCORE="already importable from $ROOT"
elif [ $DRY = 0 ] && python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . >> "$SETUP_LOG" 2>&1 \
    && python3 -c "import outcore" 2>> "$SETUP_LOG"; then
  OUTCORE="pip install -e . (editable, --no-deps, offline)"
else
  PP=$(mktemp -d /tmp/gpu_proof_pp.XXXXXX) && ln -s "$ROOT" "$PP/outcore"
  export PYTHONPATH="$PP${PYTHONPATH:+:$PYTHONPATH}"
  OUTCORE="imported from $ROOT through $PP/outcore on PYTHONPATH$([ $DRY = 0 ] && echo ' (pip install -e . failed: logs/setup.log)')"
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$([ $DRY = 1 ] && echo "$HOME/.cache/torch_extensions" || echo /tmp/torch_extensions)}
export OUTCORE_TEST_DEVICE=$DEV  # the test suite's device option (tests/conftest.py)
W="$WHEELS" L="$LIBAIO" O="$OUTCORE" python3 -c '
import json, os
failed = os.environ["W"].startswith("pip install failed") or "failed" in os.environ["O"]
status = "failed" if failed else "passed" if os.environ["W"].startswith("installed") else "partial"
print(json.dumps({"status": status, "wheels": os.environ["W"], "libaio": os.environ["L"],
                  "outcore": os.environ["O"], "pythonpath": os.environ.get("PYTHONPATH")}, indent=1))' > "$WORK/setup.json"
finish setup setup.json 0 $(($(now) - s))

# --- the stages -----------------------------------------------------------------------------
NVME=${PROOF_NVME_DIR:-/tmp}  # ZeRO-Infinity's swap (env.json and peers_*.json say which disk it is)
run_stage env env.json "$B_ENV" python3 scripts/_gpu_proof.py env --device "$DEV" --out-dir "$WORK" --nvme-dir "$NVME" \
  "${DRYFLAG[@]}"

# DeepSpeed's cpu_adam and async_io JIT-build in the background (minutes of one CPU core each)
# while the tests and the kernels run; the timed CPU-heavy stages (step, peers, race) wait for it.
DS_T=$(clip $B_DSOPS) DS_START=$(now)
[ "$DS_T" -ge 1 ] || DS_T=1  # timeout 0 would mean no limit
( timeout -s INT -k 15 "$DS_T" python3 scripts/_gpu_proof.py ds-ops > "$WORK/ds_ops.json.part" \
    2> "$WORK/logs/ds_ops.log"; echo "$? $(date +%s)" > "$WORK/ds_ops.rc" ) &
DS_PID=$!
export PROOF_BACKGROUND="DeepSpeed op JIT build (CPU) in the background"

run_stage tests tests.json "$B_TESTS" python3 scripts/_gpu_proof.py tests --work "$WORK" --budget $(($(clip $B_TESTS) - 25)) "${DRYFLAG[@]}"
clear_locks outcore_adamw8bit_cpu
kill -0 $DS_PID 2> /dev/null || unset PROOF_BACKGROUND  # kernels.json says whether it overlapped
run_stage kernels kernels.json "$B_KERNELS" python3 scripts/bench_kernels.py --device "$DEV" "${DRYFLAG[@]}" --json
unset PROOF_BACKGROUND

wait $DS_PID
mv "$WORK/ds_ops.json.part" "$WORK/ds_ops.json"
clear_locks cpu_adam async_io pin_memory
read -r DS_RC DS_END < "$WORK/ds_ops.rc"
finish ds_ops ds_ops.json "$DS_RC" $((DS_END - DS_START))
rm -f "$WORK/ds_ops.rc"

run_step_bench step_1.7b step_1.7b.json --shape 1.7b
# the same step with the optimizer state updated by the CPU where it lives (HOST RAM): only
# gradients and weights cross the link (torchao's CPU offload moves as little)
run_step_bench step_1.7b_host step_1.7b_host.json --shape 1.7b --update-on host
run_step_bench step_8b step_8b.json --shape 8b --blocks 4
# long context: the 8B shape (2 of its 32 blocks: the length hardly depends on the depth, the
# checkpoints of the others are off the GPU) at the longest context the plan finds under the 24 GiB
# cap, with the activation policy that gets there and the tiled MLP; one warm-up, one timed step
BUDGET=$B_LONG STAGE_SEQ=max STAGE_BATCH=1 run_step_bench long_8b long_8b.json --shape 8b --blocks 2 \
  --device-mem 24GiB --seq-tile auto --steps 1 --no-measure

PEER_ARGS=(--device "$DEV" --seq "$SEQ" --batch "$BATCH" --steps 3 --warmup 1 --nvme-dir "$NVME" "${DRYFLAG[@]}" --json)
run_stage peers_1.7b peers_1.7b.json "$B_PEERS" python3 scripts/bench_peers.py --shape 1.7b "${PEER_ARGS[@]}" \
  "${PEERS[@]}" --budget-s $(($(clip $B_PEERS) - 10))
run_stage peers_8b peers_8b.json "$B_PEERS8" python3 scripts/bench_peers.py --shape 8b --blocks 4 "${PEER_ARGS[@]}" \
  "${PEERS8[@]}" --budget-s $(($(clip $B_PEERS8) - 10))
python3 scripts/_gpu_proof.py merge "$WORK/peers_1.7b.json" "$WORK/peers_8b.json" > "$WORK/peers.json" 2>> "$WORK/logs/peers.log"

run_stage race race.json "$B_RACE" python3 scripts/_gpu_proof.py race --budget $(($(clip $B_RACE) - 5)) -- \
  python3 scripts/bench_gpu_step.py --device "$DEV" --shape 1.7b --blocks 2 --steps 2 --seq "$SEQ" \
  --batch "$BATCH" --deterministic --no-measure "${DRYFLAG[@]}" --json

python3 scripts/_gpu_proof.py summary --elapsed $(($(now) - START)) "${BOOKS[@]}"
