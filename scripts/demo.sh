#!/usr/bin/env bash
# The paper's story on scikit-learn's bundled 8x8 digits, on a CPU in a few minutes (README: `make demo`).
#
# 1. Trains four small CNNs: Gaussian training at sigma 0.25 and 0.5 (§3), the paper's method (§5, Alg. 2)
#    and Consistency (a baseline of §6) at sigma 0.25.
# 2. Certifies every test digit (360) with CERTIFY, N = 10,000, alpha = 0.001 (App. C.2 uses N = 100,000).
# 3. tools/demo_report.py writes, with analyze.py's functions, the ACR / certified-accuracy table (Table 3's
#    shape), the best-over-sigma envelope (§7), the ECDF of pA with its dominance report (App. B) and
#    report.md, which says in numbers whether the paper's claim shows: the method raises ACR while lowering
#    clean accuracy or the ECDF at low pA, relative to Gaussian training.
#
# Usage: bash scripts/demo.sh      (or `make demo`; everything lands in runs/demo, started afresh)
# Size knobs (the test runs a small demo): DEMO_EPOCHS (default 20), DEMO_MAX_BATCHES (batches per epoch;
# default: all), DEMO_N (10000), DEMO_MAX (default: all test digits), DEMO_OUT (runs/demo); PYTHON
# (python3); DEMO_CERTIFY_FLAGS (extra certify.py flags, e.g. "--precision bf16" on a slow CPU; the
# certificate then holds for the bf16 classifier); DEMO_NATIVE_ISA=1 (the math libraries unpinned, below).
source "$(dirname "$0")/help.sh"
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
EPOCHS=${DEMO_EPOCHS:-20}
N=${DEMO_N:-10000}
MAX=${DEMO_MAX:-}
MAX_BATCHES=${DEMO_MAX_BATCHES:-}
OUT=${DEMO_OUT:-runs/demo}
CERTIFY_FLAGS=${DEMO_CERTIFY_FLAGS:-}
export PYTHONUNBUFFERED=1   # progress lines appear as they are printed, not when a pipe buffer fills
# Two jobs run side by side with one thread each: for a model this small, two single-threaded processes on
# 2 cores do about twice the work of one two-threaded process.
export OMP_NUM_THREADS=1
# The same report on the AMD EPYCs measured, with AVX-512 or not (docs/demo.md, "The same file on every CPU";
# an Intel Xeon gives other last digits): the math libraries
# pick their kernels by the CPU's widest instruction set, and AVX-512 kernels sum in another order than AVX2
# ones, so the trained weights, and with them the report, would differ in their last digits. Pinned to AVX2
# (each may be set beforehand to another value): oneDNN (convolutions; DNNL_ is its older name), ATen's own
# vectorised kernels, MKL (matrix products) and numpy's OpenBLAS. DEMO_NATIVE_ISA=1 leaves them unpinned.
if [ "${DEMO_NATIVE_ISA:-0}" != 1 ]; then
    export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX2} DNNL_MAX_CPU_ISA=${DNNL_MAX_CPU_ISA:-AVX2}
    export ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-avx2} MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-AVX2}
    export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
fi

# The demo folder is the demo's own: start afresh, but never delete a folder the demo did not make (its
# marker), nor anything in it that the demo did not write (its record, the marker .demo, lists every file with
# its content's hash when the demo ends): tools/remove_outputs.py checks the whole tree before it removes a file.
if [ -L "$OUT" ] || { [ -e "$OUT" ] && [ ! -f "$OUT/.demo" ]; }; then   # a link is not the demo's folder either
    echo "demo: $OUT exists and was not made by the demo; set DEMO_OUT to another folder" >&2
    exit 2
fi
if [ -e "$OUT" ]; then   # a previous demo's outputs, each checked against the records before it goes
    "$PYTHON" tools/remove_outputs.py "$OUT" || exit 2
fi
mkdir -p "$OUT/train" "$OUT/certify"
touch "$OUT/.demo"
trap '"$PYTHON" tools/remove_outputs.py --record "$OUT"' EXIT   # however the demo ends, Ctrl-C included
start=$SECONDS

# model NAME SCRIPT FLAGS...: train NAME on digits, then certify every test digit; lines prefixed [NAME].
model() {
    local name=$1 script=$2
    shift 2
    {
        "$PYTHON" "$script" --dataset digits --epochs "$EPOCHS" ${MAX_BATCHES:+--max-batches "$MAX_BATCHES"} \
            --outdir "$OUT/train/$name" "$@" &&
        "$PYTHON" certify.py --checkpoint "$OUT/train/$name/checkpoint.pth.tar" --N "$N" --alpha 0.001 \
            --batch 2500 ${MAX:+--max "$MAX"} --outfile "$OUT/certify/$name.tsv" $CERTIFY_FLAGS
    } 2>&1 | sed -u "s/^/[$name] /"
}

echo "demo: training 4 models on digits ($EPOCHS epochs) and certifying each with N = $N, two at a time"
# Two lanes of about equal work. Each lane is its own process group (set -m), so that Ctrl-C or a failure in
# one lane stops the other lane too.
set -m
( model gaussian_sigma0.25 train_gaussian.py --sigma 0.25 &&
  model ours_sigma0.25 train_ours.py --sigma 0.25 ) &
lane1=$!
( model gaussian_sigma0.5 train_gaussian.py --sigma 0.5 &&
  model consistency_sigma0.25 train_baselines.py --method consistency --sigma 0.25 ) &
lane2=$!
set +m
stop_lanes() { kill -- -$lane1 -$lane2 2>/dev/null || true; }
trap 'stop_lanes; exit 130' INT TERM
failed=0
for _ in 1 2; do
    wait -n || { failed=1; stop_lanes; }
done
trap - INT TERM
if [ $failed = 1 ]; then
    echo "demo: a training or certification step failed (its lines above say why)" >&2
    exit 1
fi

# The logs' names give the label (gaussian, ours, consistency) and sigma of each row. demo_report.py writes
# what `analyze.py table`, `envelope` and `ecdf` write with `--out "$OUT"`, then report.md.
echo "demo: analysing the certification logs"
"$PYTHON" tools/demo_report.py "$OUT"/certify/{gaussian,ours,consistency}_sigma0.25.tsv \
    "$OUT/certify/gaussian_sigma0.5.tsv" --out "$OUT" --seconds $((SECONDS - start))
