#!/usr/bin/env bash
# Seconds of one full CIFAR-10 training epoch of every baseline and of Gaussian training (cifar_resnet20,
# released sigma = 0.5 settings, --amp --channels-last): the timing of the baselines.
#   bash scripts/epoch_times.sh      (about 3 hours on a 2-core CPU)
# Each run writes runs/epoch_times/<name>/log.tsv; its `time` column (training plus the noisy evaluation on
# the 10,000 test images) is printed at the end; a second call skips the runs that finished. Gaussian
# training runs at every m a baseline uses (1, 2, 4, 8, 16), so each baseline has its reference. CAT-RS's
# soft target is made with one vote per image (its cost does not depend on the labels; the command is the
# real one).
source "$(dirname "$0")/help.sh"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DATA_DIR=${DATA_DIR:-${RS_DATA_DIR:-data}}
RUNS=${RUNS:-runs/epoch_times}
COMMON=(--dataset cifar10 --data-dir "$DATA_DIR" --arch cifar_resnet20 --sigma 0.5 --epochs 1 --workers 0
        --amp --channels-last)
one() {  # NAME SCRIPT FLAGS...
    local name=$1 script=$2
    shift 2
    # finished in an earlier call; a folder left by a stopped run (no checkpoint yet) is started again in place
    [ -f "$RUNS/$name/checkpoint.pth.tar" ] && return 0
    "$PYTHON" "$script" "${COMMON[@]}" --outdir "$RUNS/$name" "$@"
}
one gaussian_m2 train_gaussian.py --m 2
one consistency train_baselines.py --method consistency
one stability train_baselines.py --method stability
one gaussian_m1 train_gaussian.py --m 1
one gaussian_m4 train_gaussian.py --m 4
one smoothmix train_baselines.py --method smoothmix
one smoothadv train_baselines.py --method smoothadv
if [ ! -f "$RUNS/catrs_target.pt" ]; then
    "$PYTHON" train_baselines.py --make-catrs-target --checkpoint "$RUNS/gaussian_m2/checkpoint.pth.tar" \
        --data-dir "$DATA_DIR" --N 1 --batch 1000 --out "$RUNS/catrs_target.pt"
fi
one catrs train_baselines.py --method catrs --catrs-target "$RUNS/catrs_target.pt"
one macer train_baselines.py --method macer
one gaussian_m8 train_gaussian.py --m 8
one gaussian_m16 train_gaussian.py --m 16
for log in "$RUNS"/*/log.tsv; do
    printf '%-14s %8.0f s\n' "$(basename "$(dirname "$log")")" "$(awk -F'\t' 'NR == 2 {print $2}' "$log")"
done
