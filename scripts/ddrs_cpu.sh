#!/usr/bin/env bash
# DDRS on CIFAR-10 at CPU scale (docs/ddrs.md: a small-scale check), committed under results/ddrs_cpu:
# a Gaussian sigma_0 = 0.25 LeNet (the shortened schedule of scripts/cifar_cpu.sh), certified on every SKIP-th
# test image (default 20: 500 images, the committed run) with N = 10,000, alpha = 0.001:
#   - at the fixed sigma_0 (certify.py);
#   - with DS (Algorithm 1: K = 100, M = 1) at each step size of LRS (default 1e-4, the official code's, 1e-3,
#     3e-3, 1e-2 and 3e-2), each followed by the memory (Algorithm 3);
#   - with the semi-elastic sigma and its sound radius (ddrs.py certify --semi-elastic, r = 0.01, k = 20, m = 5);
# then the table of all logs and the step-size report (ddrs.py report). About 2 CPU-hours on one core.
#   bash scripts/ddrs_cpu.sh
source "$(dirname "$0")/help.sh"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DATA_DIR=${DATA_DIR:-${RS_DATA_DIR:-data}}
RUNS=${RUNS:-runs/ddrs_cpu}
OUT=${OUT:-results/ddrs_cpu}
SKIP=${SKIP:-20}
LRS=${LRS:-0.0001 0.001 0.003 0.01 0.03}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

CKPT=$RUNS/gaussian_sigma0.25/checkpoint.pth.tar
if [ ! -f "$RUNS/gaussian_sigma0.25/DONE" ]; then
    resume=()
    if [ -f "$CKPT" ]; then resume=(--resume); fi
    $PYTHON train_gaussian.py --dataset cifar10 --data-dir "$DATA_DIR" --arch lenet --sigma 0.25 --m 2 --lr_step 6 \
        --epochs 10 --workers 0 --amp --channels-last --outdir "$RUNS/gaussian_sigma0.25" "${resume[@]}"
    touch "$RUNS/gaussian_sigma0.25/DONE"
fi
CERTIFY=(--checkpoint "$CKPT" --dataset cifar10 --data-dir "$DATA_DIR" --N 10000 --alpha 0.001 --skip "$SKIP" --batch 1000
         --precision bf16)
$PYTHON certify.py "${CERTIFY[@]}" --outfile "$OUT/fixed_noise_0.25.tsv"
logs=("$OUT/fixed_noise_0.25.tsv")
labels=(fixed)
for lr in $LRS; do
    $PYTHON ddrs.py certify "${CERTIFY[@]}" --K 100 --lr "$lr" --outfile "$OUT/ds_lr${lr}_noise_0.25.tsv"
    $PYTHON ddrs.py memory "$OUT/ds_lr${lr}_noise_0.25.tsv" --data-dir "$DATA_DIR" --summary "$OUT/memory_lr${lr}.txt"
    logs+=("$OUT/ds_lr${lr}_noise_0.25.tsv")
    labels+=("ds_lr$lr")
done
$PYTHON ddrs.py certify "${CERTIFY[@]}" --semi-elastic --outfile "$OUT/semi_elastic_noise_0.25.tsv"
logs+=("$OUT/semi_elastic_noise_0.25.tsv")
labels+=(semi_elastic)
$PYTHON analyze.py table "${logs[@]}" --labels "${labels[@]}" --radii 0 0.25 0.5 0.75 1.0 --allow-different mode \
    --out "$OUT"
$PYTHON ddrs.py report "${logs[@]:1}" --fixed "$OUT/fixed_noise_0.25.tsv" --out "$OUT"
