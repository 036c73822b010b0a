#!/usr/bin/env bash
# Table 3 (and Figure 6) for one sigma: CIFAR-10, every method, ResNet-110, 150 epochs, CERTIFY on the full
# test set with N = 100,000, alpha = 0.001.
#
# Usage: DATA_DIR=/data/cifar10 bash scripts/table3.sh 0.5      (or: make table3 SIGMA=0.5 DATA_DIR=...)
# METHODS="gaussian ours" limits the methods (default: all seven, in the table's order). Writes
#   $RUNS/cifar10/<method>_sigma<S>/            training runs (checkpoint.pth.tar, log.tsv, args.json)
#   $RUNS/certify/cifar10/<method>/noise_<S>.tsv  certification logs (the paper repository's layout)
#   $RUNS/tables/table3_sigma<S>/              analyze.py's table (.md/.tex/.tsv) and Figure 6's curves
# CAT-RS first needs its teacher, a Gaussian sigma = 0.25 model trained as Cohen et al. (one noise draw per
# image, --m 1: the CAT-RS repository's recipe; not this table's m = 4 Gaussian run, which would be a sharper
# teacher), trained once into $RUNS/cifar10/catrs_teacher_sigma0.25 and shared by every sigma, and its soft
# labels on the training set. Other settings (RUNS, GPUS, EXTRA_TRAIN, ...): scripts/lib.sh.
source "$(dirname "$0")/lib.sh"
SIGMA=$(sigma_arg "${1:-}" "bash scripts/table3.sh SIGMA")
METHODS=${METHODS:-gaussian smoothadv macer consistency smoothmix catrs ours}
read -r -a EXTRA_TARGET_ARGS <<< "${EXTRA_TARGET:-}"   # e.g. "--N 1" for a smoke run of the CAT-RS target
D=cifar10

logs=()
for method in $METHODS; do
    dir=$RUNS/$D/${method}_sigma$SIGMA
    case $method in
        gaussian) train "$dir" train_gaussian.py --dataset $D --sigma "$SIGMA" ;;   # m = 4 (§6)
        ours) train "$dir" train_ours.py --dataset $D --sigma "$SIGMA" ;;           # Table 6's setting
        catrs)
            target=$RUNS/$D/catrs_target.pt
            teacher=$RUNS/$D/catrs_teacher_sigma0.25
            train "$teacher" train_gaussian.py --dataset $D --sigma 0.25 --m 1   # Cohen et al.'s m = 1
            if [ ! -f "$target" ]; then
                run "$PYTHON" train_baselines.py --make-catrs-target --data-dir "$DATA_DIR" \
                    --checkpoint "$teacher/checkpoint.pth.tar" --out "$target" \
                    "${EXTRA_TARGET_ARGS[@]}"
            fi
            train "$dir" train_baselines.py --method catrs --dataset $D --sigma "$SIGMA" --catrs-target "$target" ;;
        smoothadv | macer | consistency | smoothmix)
            train "$dir" train_baselines.py --method "$method" --dataset $D --sigma "$SIGMA" ;;
        *) echo "table3.sh: unknown method $method" >&2; exit 2 ;;
    esac
    log=$RUNS/certify/$D/$method/noise_$SIGMA.tsv
    certify "$dir/checkpoint.pth.tar" "$SIGMA" "$log"
    logs+=("$log")
done
run "$PYTHON" analyze.py table "${logs[@]}" --out "$RUNS/tables/table3_sigma$SIGMA"
