#!/usr/bin/env bash
# The grid benchmark through certify.py itself on the bundled digits, committed under results/grid_digits/certify_py
# (docs/speed.md): the six-epoch sigma = 0.5 digits_cnn (trained here unless its folder holds DONE), 100 test
# digits (every 3rd), certified four ways, each with its own noise (--seed 0, 2, 4, 5: independent arms):
# CERTIFY with N = 100,000 (the reference), certify.py --radii 0.25 ... 1.25 with the budget N_max = 100,000,
# the single radius 0.5 (r = 0 a level too) and r = 0.5 alone (--no-zero-level). Then tools/bench.py's table from the
# logs, with each arm's certified accuracy minus the reference's and its interval. About 8 CPU-minutes; a second
# call resumes.
#   bash scripts/grid_digits.sh
RUNS=${RUNS:-runs/grid_digits}
source "$(dirname "$0")/lib.sh"
OUT=${OUT:-results/grid_digits/certify_py}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DIGITS=(--dataset digits --N0 100 --alpha 0.001 --skip 3 --max 100 --batch 1000)

train "$RUNS/gaussian_sigma0.5_6ep" train_gaussian.py --dataset digits --sigma 0.5 --epochs 6 --workers 0
checkpoint=$RUNS/gaussian_sigma0.5_6ep/checkpoint.pth.tar
certify "$checkpoint" 0.5 "$OUT/certify_N100000.tsv" "${DIGITS[@]}" --N 100000 --seed 0
certify "$checkpoint" 0.5 "$OUT/grid.tsv" "${DIGITS[@]}" --N 100000 --seed 2 --radii 0.25 0.5 0.75 1 1.25
certify "$checkpoint" 0.5 "$OUT/single_r0.5.tsv" "${DIGITS[@]}" --N 100000 --seed 4 --radii 0.5
certify "$checkpoint" 0.5 "$OUT/r0.5_alone.tsv" "${DIGITS[@]}" --N 100000 --seed 5 --radii 0.5 --no-zero-level
logs=("$OUT/certify_N100000.tsv" "$OUT/grid.tsv" "$OUT/single_r0.5.tsv" "$OUT/r0.5_alone.tsv")
if [ "$DRY_RUN" = 1 ]; then
    run "$PYTHON" tools/bench.py --sections g --grid-logs "${logs[@]}"
else
    run "$PYTHON" tools/bench.py --sections g --grid-logs "${logs[@]}" --report "$OUT/bench.txt"
fi
