#!/usr/bin/env bash
# Table 5 for one sigma: the ablation of the paper's method on CIFAR-10, eight train_ours.py runs with each
# part (discard §5.1, reweight §5.2, adaptive attack §5.3) on or off, each certified as Table 3.
#
# Usage: DATA_DIR=/data/cifar10 bash scripts/table5.sh 0.5      (or: make table5 SIGMA=0.5 DATA_DIR=...)
# VARIANTS="gaussian all" limits the runs. The row with every part on is the same command as Table 3's
# "ours"; the row with none is Gaussian training as the paper's code runs it (sampling with replacement).
# Writes $RUNS/cifar10_ablation/sigma<S>/<variant>/, $RUNS/certify/cifar10_ablation/<variant>/noise_<S>.tsv
# and $RUNS/tables/table5_sigma<S>/. Other settings (RUNS, GPUS, EXTRA_TRAIN, ...): scripts/lib.sh; and
#   OURS_FLAGS   train_ours.py flags for every variant, before the variant's switches (which win), e.g. a
#                shortened schedule (scripts/table5_cpu.sh)
#   LOGS, TABLES where the certification logs and the table go (defaults above)
source "$(dirname "$0")/lib.sh"
SIGMA=$(sigma_arg "${1:-}" "bash scripts/table5.sh SIGMA")
read -r -a OURS_ARGS <<< "${OURS_FLAGS:-}"
LOGS=${LOGS:-$RUNS/certify/cifar10_ablation}
TABLES=${TABLES:-$RUNS/tables/table5_sigma$SIGMA}
VARIANTS=${VARIANTS:-gaussian discard weight attack discard_weight discard_attack weight_attack all}

logs=()
parts=()
for variant in $VARIANTS; do
    case $variant in                       # the switches of train_ours.py, and the parts analyze.py marks
        gaussian)       flags=(--no-discard --no-reweight --T 0); on=none ;;
        discard)        flags=(--no-reweight --T 0);              on=discard ;;
        weight)         flags=(--no-discard --T 0);               on=weight ;;
        attack)         flags=(--no-discard --no-reweight);       on=attack ;;
        discard_weight) flags=(--T 0);                            on=discard+weight ;;
        discard_attack) flags=(--no-reweight);                    on=discard+attack ;;
        weight_attack)  flags=(--no-discard);                     on=weight+attack ;;
        all)            flags=();                                 on=discard+weight+attack ;;
        *) echo "table5.sh: unknown variant $variant" >&2; exit 2 ;;
    esac
    dir=$RUNS/cifar10_ablation/sigma$SIGMA/$variant
    train "$dir" train_ours.py --dataset cifar10 --sigma "$SIGMA" "${OURS_ARGS[@]}" "${flags[@]}"
    keep_log "$dir" "$TABLES/${variant}_log.tsv"    # the training log (wall time per epoch) beside the table
    log=$LOGS/$variant/noise_$SIGMA.tsv
    certify "$dir/checkpoint.pth.tar" "$SIGMA" "$log"
    logs+=("$log")
    parts+=("$on")
done
run "$PYTHON" analyze.py ablation "${logs[@]}" --parts "${parts[@]}" --out "$TABLES"
