#!/usr/bin/env bash
# DDRS on CIFAR-10 at CPU scale (README, DDRS; DDRS.md §6's small-scale check), committed under results/ddrs_cpu:
# a Gaussian sigma_0 = 0.25 LeNet (the shortened schedule of scripts/cifar_cpu.sh), certified on every SKIP-th
# test image (default 20: 500 images, the committed run) with N = 10,000, alpha = 0.001, at the fixed sigma_0
# and with DS (K = 100, M = 1, step 1e-4:
# DDRS.md's defaults), then the memory (Algorithm 3) and the table. About 30 CPU-minutes on 2 cores.
#   DATA_DIR=../shared/data/cifar10 bash scripts/ddrs_cpu.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DATA_DIR=${DATA_DIR:-${RS_DATA_DIR:-data}}
RUNS=${RUNS:-runs/ddrs_cpu}
OUT=${OUT:-results/ddrs_cpu}
SKIP=${SKIP:-20}
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
$PYTHON ddrs.py certify "${CERTIFY[@]}" --K 100 --outfile "$OUT/ds_noise_0.25.tsv"
$PYTHON ddrs.py memory "$OUT/ds_noise_0.25.tsv" --data-dir "$DATA_DIR" --summary "$OUT/memory.txt"
$PYTHON analyze.py table "$OUT/fixed_noise_0.25.tsv" "$OUT/ds_noise_0.25.tsv" --labels fixed ds \
    --radii 0 0.25 0.5 0.75 1.0 --out "$OUT"
