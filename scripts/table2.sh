#!/usr/bin/env bash
# Table 2 and Figure 5: gradient l2 norms of easy (pA > 0.5) and hard (pA < 0.5) training examples under each
# method's own loss, sigma = 0.5 on CIFAR-10, and under Gaussian training with and without the adaptive attack.
#
# Usage: DATA_DIR=/data/cifar10 bash scripts/table2.sh 0.5      (or: make table2 SIGMA=0.5 DATA_DIR=...)
# Needs the trained models of Table 3 at that sigma (make table3 SIGMA=0.5; the ACR column of Table 2 is
# Table 3's). Figure 5 runs train_ours.py's loss with and without the attack on the Gaussian model: the
# figure shows what the attack does to Gaussian training. PROBE (default 1000) training examples are probed,
# each pA from 100 noisy copies. Writes gradnorm_<method>.tsv beside each checkpoint and analyze.py's table
# and histograms to $RUNS/tables/table2_sigma<S>/. Other settings (RUNS, ...): scripts/lib.sh.
source "$(dirname "$0")/lib.sh"
SIGMA=$(sigma_arg "${1:-0.5}" "bash scripts/table2.sh [SIGMA]")
METHODS=${METHODS:-gaussian smoothadv consistency smoothmix catrs}
PROBE=${PROBE:-1000}
D=cifar10

files=() acrs=()
for method in $METHODS; do
    checkpoint=$RUNS/$D/${method}_sigma$SIGMA/checkpoint.pth.tar
    need "$checkpoint" "train it first: make table3 SIGMA=$SIGMA METHODS=$method"
    case $method in
        gaussian) run "$PYTHON" train_gaussian.py --gradnorm "$checkpoint" --probe "$PROBE" --data-dir "$DATA_DIR" ;;
        catrs) run "$PYTHON" train_baselines.py --method catrs --gradnorm "$checkpoint" --probe "$PROBE" \
                   --catrs-target "$RUNS/$D/catrs_target.pt" --data-dir "$DATA_DIR" ;;
        *) run "$PYTHON" train_baselines.py --method "$method" --gradnorm "$checkpoint" --probe "$PROBE" \
               --data-dir "$DATA_DIR" ;;
    esac
    files+=("$(dirname "$checkpoint")/gradnorm_$method.tsv")
    log=$RUNS/certify/$D/$method/noise_$SIGMA.tsv    # Table 2's ACR column, where make table3 certified it
    if [ "$DRY_RUN" = 1 ] || [ -f "$log" ]; then acrs+=("$log"); else acrs+=(-); fi
done
gaussian=$RUNS/$D/gaussian_sigma$SIGMA
need "$gaussian/checkpoint.pth.tar" "train it first: make table3 SIGMA=$SIGMA METHODS=gaussian"
run "$PYTHON" train_ours.py --gradnorm "$gaussian/checkpoint.pth.tar" --probe "$PROBE" --data-dir "$DATA_DIR"
files+=("$gaussian/gradnorm_ours_noattack.tsv" "$gaussian/gradnorm_ours_attack.tsv")
acrs+=(- -)    # Fig. 5's rows: the Gaussian model under the paper's loss
run "$PYTHON" analyze.py gradnorm "${files[@]}" --acr "${acrs[@]}" --out "$RUNS/tables/table2_sigma$SIGMA"
