#!/usr/bin/env bash
# The CPU-scale CIFAR-10 result committed under results/cifar10_cpu (docs/cpu_results.md):
# LeNet at sigma = 0.5, Gaussian training against the paper's method, shortened schedules, certified on every
# 20th test image (500) with N = 10,000, alpha = 0.001 (with the true label's votes, so the ECDF covers
# [0, 1]). About 1.5 CPU-hours on 2 cores; a second call resumes (training and certification) or skips.
#   bash scripts/cifar_cpu.sh
# scripts/fig3_cpu.sh uses both runs (RUNS, default runs/cifar_cpu) for Figure 3 and Table 2.
RUNS=${RUNS:-runs/cifar_cpu}
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/cpu_settings.sh"
OUT=${OUT:-results/cifar10_cpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# The schedule of scripts/cpu_settings.sh with m = 2 noise copies. Algorithm 2 scaled down: discard at Et = 7
# (paper 70 of 150) with pA from N = 32 samples (paper 100), reweight at Et (every 4 epochs), a 2-step attack
# (paper T = 6) with the paper's eps = 0.25.
OURS=(--Et 7 --pt 0.4 --N 32 --reweight_every 4 --T 2 --eps 0.25)

train "$RUNS/gaussian" train_gaussian.py "${CPU_SCHEDULE[@]}" --sigma 0.5 --m 2
train "$RUNS/ours" train_ours.py "${CPU_SCHEDULE[@]}" --sigma 0.5 --m 2 "${OURS[@]}"
keep_log "$RUNS/gaussian" "$OUT/gaussian_log.tsv"
keep_log "$RUNS/ours" "$OUT/ours_log.tsv"
certify "$RUNS/gaussian/checkpoint.pth.tar" 0.5 "$OUT/certify/gaussian_noise_0.5.tsv" "${CPU_CERTIFY[@]}"
certify "$RUNS/ours/checkpoint.pth.tar" 0.5 "$OUT/certify/ours_noise_0.5.tsv" "${CPU_CERTIFY[@]}"
LOGS=("$OUT/certify/gaussian_noise_0.5.tsv" "$OUT/certify/ours_noise_0.5.tsv")
run "$PYTHON" analyze.py table "${LOGS[@]}" --labels gaussian ours --out "$OUT"
run "$PYTHON" analyze.py envelope "${LOGS[@]}" --labels gaussian ours --out "$OUT"
run "$PYTHON" analyze.py ecdf "${LOGS[@]}" --labels gaussian ours --out "$OUT"
