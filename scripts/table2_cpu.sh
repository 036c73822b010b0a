#!/usr/bin/env bash
# Table 2 and Figure 5 at CPU scale, committed under results/table2_cpu (docs/cpu_results.md): the mean
# parameter-gradient l2 norm of easy (pA > 0.5) and hard (pA < 0.5) training examples under each method's own
# loss, on the sigma = 0.5 LeNets of scripts/fig3_cpu.sh (run it first), PROBE (default 1000) training probes
# with pA from 100 noisy copies each; and Figure 5: the paper's loss on the Gaussian model with and without
# its attack (T = 2, eps = 0.25, as the paper's method was trained here). About 7 CPU-minutes.
#   bash scripts/table2_cpu.sh
# Each loss takes the settings its model was trained with (scripts/fig3_cpu.sh); the ACR column comes from the
# models' certification logs (results/cifar10_cpu, results/fig3_cpu).
RUNS=${RUNS:-runs/cifar_cpu}
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/cpu_settings.sh"
OUT=${OUT:-results/table2_cpu}
PROBE=${PROBE:-1000}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

files=() acrs=()
for method in gaussian smoothadv consistency smoothmix catrs macer; do
    checkpoint=$RUNS/$method/checkpoint.pth.tar
    need "$checkpoint" "train it first: bash scripts/fig3_cpu.sh"
    if [ "$method" = gaussian ]; then
        run "$PYTHON" train_gaussian.py --gradnorm "$checkpoint" --m 2 --probe "$PROBE" --data-dir "$DATA_DIR" \
            --outdir "$OUT"
        acrs+=(results/cifar10_cpu/certify/gaussian_noise_0.5.tsv)
    else
        method_flags "$method"
        run "$PYTHON" train_baselines.py --method "$method" --gradnorm "$checkpoint" --probe "$PROBE" \
            --data-dir "$DATA_DIR" --outdir "$OUT" "${FLAGS[@]}"
        acrs+=("results/fig3_cpu/certify/${method}_noise_0.5.tsv")
    fi
    files+=("$OUT/gradnorm_$method.tsv")
done
run "$PYTHON" train_ours.py --gradnorm "$RUNS/gaussian/checkpoint.pth.tar" --probe "$PROBE" --data-dir "$DATA_DIR" \
    --m 2 --T 2 --eps 0.25 --outdir "$OUT"
files+=("$OUT/gradnorm_ours_noattack.tsv" "$OUT/gradnorm_ours_attack.tsv")
acrs+=(- -)    # Fig. 5's two rows probe the Gaussian model under the paper's loss: no model of their own
run "$PYTHON" analyze.py gradnorm "${files[@]}" --acr "${acrs[@]}" --out "$OUT"
