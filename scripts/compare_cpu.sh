#!/usr/bin/env bash
# Every verdict of the CPU-scale results as a difference with its interval (analyze.py compare; docs/analysis.md,
# "Verdicts"): writes compare.tsv and compare.md under results/<experiment>/compare/<b>_vs_<a>/ (and prints
# the latter). Needs only the committed logs (a few seconds per comparison):
#   bash scripts/compare_cpu.sh
# Training seeds 1 to 4 (scripts/seeds_cpu.sh) join a side each once it is certified (500 rows).
#
# The claim of the CIFAR-10 comparison (ours against Gaussian), declared here once seeds 0 to 3 were certified
# and seeds 0 to 2 compared, before seed 4's certification was complete (results/cifar10_cpu/README.md): the
# paper's point is that the method raises ACR by moving easy inputs towards pA = 1 (P(pA >= 0.99)) without
# helping hard ones (P(pA < 0.5), clean accuracy). Those four rows are the family (compare --family: the 5 %
# error is spent on them, verdicts by Holm's step-down); certified accuracy at each radius and the other shares
# of pA are exploratory, each at 95 % alone. The other comparisons (Figure 3, Table 5, DDRS) test every row
# as their family (Bonferroni): no claim of theirs is declared.
source "$(dirname "$0")/lib.sh"
CLAIM=(--family ACR "P(pA>=0.99)" "P(pA<0.5)" "clean accuracy")

# seeds LOG: the log, and those of its training seeds 1 to 4 (scripts/seeds_cpu.sh) that are complete (500 rows).
seeds() {
    local log=$1 others=() s other
    for s in 1 2 3 4; do
        other=${log/\/certify\//\/seed$s\/certify\/}
        if [ -f "$other" ] && [ "$(wc -l < "$other")" -ge 501 ]; then others+=("$other"); fi
    done
    echo "$log ${others[*]}"
}

# train_seeds LOG...: the training seed of each log's model: S for a log under seed<S>/ (scripts/seeds_cpu.sh
# trains it with --seed S), 0 for the committed run (the training scripts' default --seed). Their settings files
# record no training seed, so compare gets them from --train-seeds; sides with the same seeds are paired over
# seeds (seed S of both methods shares its initialisation and data order).
train_seeds() {
    local log seeds=()
    for log in "$@"; do
        if [[ $log =~ /seed([0-9]+)/ ]]; then seeds+=("${BASH_REMATCH[1]}"); else seeds+=(0); fi
    done
    echo "${seeds[*]}"
}

C=results/cifar10_cpu
read -r -a A <<< "$(seeds $C/certify/gaussian_noise_0.5.tsv)"
read -r -a B <<< "$(seeds $C/certify/ours_noise_0.5.tsv)"
read -r -a S <<< "$(train_seeds "${A[@]}" "${B[@]}")"
run "$PYTHON" analyze.py compare "${A[@]}" --vs "${B[@]}" --labels gaussian ours --train-seeds "${S[@]}" \
    "${CLAIM[@]}" --out $C/compare
# the same claim with the seeds taken as unrelated (no --train-seeds): what pairing by seed adds
run "$PYTHON" analyze.py compare "${A[@]}" --vs "${B[@]}" --labels gaussian ours "${CLAIM[@]}" \
    --out $C/compare/unpaired_seeds
if [ ${#A[@]} -gt 1 ] && [ ${#B[@]} -gt 1 ]; then   # Table 8's layout: mean ± std over the training seeds
    run "$PYTHON" analyze.py table --group-by-seed "${A[@]}" "${B[@]}" --radii 0 0.25 0.5 0.75 1 1.25 1.5 \
        --out $C/seeds
fi

F=results/fig3_cpu
for m in consistency smoothmix macer catrs smoothadv; do
    run "$PYTHON" analyze.py compare $C/certify/gaussian_noise_0.5.tsv $F/certify/${m}_noise_0.5.tsv \
        --labels gaussian "$m" --out $F/compare/${m}_vs_gaussian
done

T=results/table5_cpu
# each variant against Gaussian training, and each combination against the parts it combines
for pair in discard:gaussian weight:gaussian attack:gaussian discard_weight:gaussian discard_attack:gaussian \
            weight_attack:gaussian all:gaussian discard_weight:discard discard_weight:weight \
            discard_attack:discard discard_attack:attack weight_attack:weight weight_attack:attack \
            all:discard_weight all:discard_attack all:weight_attack; do
    b=${pair%%:*} a=${pair##*:}
    read -r -a A <<< "$(seeds $T/certify/$a/noise_0.25.tsv)"
    read -r -a B <<< "$(seeds $T/certify/$b/noise_0.25.tsv)"
    read -r -a S <<< "$(train_seeds "${A[@]}" "${B[@]}")"
    run "$PYTHON" analyze.py compare "${A[@]}" --vs "${B[@]}" --labels "$a" "$b" --train-seeds "${S[@]}" \
        --out $T/compare/${b}_vs_$a
done

all_seeds=() several=1   # Table 8's layout for the eight rows, once each has more than one training seed
for v in gaussian discard weight attack discard_weight discard_attack weight_attack all; do
    read -r -a S <<< "$(seeds $T/certify/$v/noise_0.25.tsv)"
    if [ ${#S[@]} -lt 2 ]; then several=0; fi
    all_seeds+=("${S[@]}")
done
if [ $several = 1 ]; then
    run "$PYTHON" analyze.py table --group-by-seed "${all_seeds[@]}" --radii 0 0.25 0.5 0.75 --out $T/seeds
fi

# each DS step size and the sound semi-elastic sigma against the fixed sigma_0: a sigma per input against one
# sigma is a difference of mode (what a row certifies), compared by design (--allow-different mode)
D=results/ddrs_cpu
for b in ds_lr0.0001 ds_lr0.001 ds_lr0.003 ds_lr0.01 ds_lr0.03 semi_elastic; do
    if [ -f $D/${b}_noise_0.25.tsv ]; then
        run "$PYTHON" analyze.py compare $D/fixed_noise_0.25.tsv $D/${b}_noise_0.25.tsv --labels fixed "$b" \
            --allow-different mode --out $D/compare/${b}_vs_fixed
    fi
done
if [ -f $D/ds_lr0.03_noise_0.25.tsv ]; then   # the largest step against the step before: ACR against accuracy
    run "$PYTHON" analyze.py compare $D/ds_lr0.01_noise_0.25.tsv $D/ds_lr0.03_noise_0.25.tsv --labels ds_lr0.01 \
        ds_lr0.03 --out $D/compare/ds_lr0.03_vs_ds_lr0.01
fi
