#!/usr/bin/env bash
# The grid benchmark of tools/bench.py (g) on CIFAR-10 at CPU scale, committed under results/grid_cpu
# (docs/certification.md, "--radii"): the Gaussian LeNets of scripts/ddrs_cpu.sh (sigma 0.25) and scripts/cifar_cpu.sh
# (sigma 0.5), every 20th test image (500), each certified seven ways on the same examples, each way with its own
# noise (--seed 0 to 6: the arms are independent, so their agreement is measured, not built in):
# CERTIFY with N = 100,000 (the reference) and 10,000, certify.py --radii with the budget N_max = 100,000
# (the grid 0.25, 0.5, ... up to the budget's ceiling sigma x 3.8), the same without the final look, the
# single radius 0.5 (with r = 0, the prediction, as a level too) and r = 0.5 alone (--no-zero-level), and r = 0.5
# alone again on half the budget (N_max = 50,000: its cost is mostly the few images next to the threshold,
# which run to the budget; what halving it costs in certificates is measured against CERTIFY at 100,000).
# Then tools/bench.py's table from the logs. About 2 CPU-hours per sigma in fp32 on one AVX2 core; a second call resumes.
# SIGMAS picks the noise levels, so that two cores can run one each:
#   bash scripts/grid_cpu.sh
#   SIGMAS=0.5 bash scripts/grid_cpu.sh
source "$(dirname "$0")/lib.sh"
OUT=${OUT:-results/grid_cpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# fp32: bf16 is emulated on CPUs without avx512_bf16 (8x slower on AVX2 alone, results/speed/bf16_cpu.txt);
# PRECISION=bf16 where the CPU has it natively
CPU_CERTIFY=(--dataset cifar10 --N0 100 --alpha 0.001 --skip 20 --batch 1000 --precision "${PRECISION:-fp32}")

read -r -a SIGMA_LIST <<< "${SIGMAS:-0.25 0.5}"
for sigma in "${SIGMA_LIST[@]}"; do
    case $sigma in
        0.25) checkpoint=runs/ddrs_cpu/gaussian_sigma0.25/checkpoint.pth.tar; grid=(0.25 0.5 0.75)
              hint="train it: bash scripts/ddrs_cpu.sh" ;;
        0.5)  checkpoint=runs/cifar_cpu/gaussian/checkpoint.pth.tar; grid=(0.25 0.5 0.75 1.0 1.25 1.5 1.75)
              hint="train it: bash scripts/cifar_cpu.sh" ;;
        *)    echo "grid_cpu.sh: SIGMAS may hold 0.25 and 0.5, not $sigma" >&2; exit 2 ;;
    esac
    need "$checkpoint" "$hint"
    dir=$OUT/sigma$sigma
    certify "$checkpoint" "$sigma" "$dir/grid.tsv" "${CPU_CERTIFY[@]}" --N 100000 --seed 2 --radii "${grid[@]}"
    certify "$checkpoint" "$sigma" "$dir/single_r0.5.tsv" "${CPU_CERTIFY[@]}" --N 100000 --seed 4 --radii 0.5
    certify "$checkpoint" "$sigma" "$dir/r0.5_alone.tsv" "${CPU_CERTIFY[@]}" --N 100000 --seed 5 --radii 0.5 --no-zero-level
    certify "$checkpoint" "$sigma" "$dir/r0.5_alone_N50000.tsv" "${CPU_CERTIFY[@]}" --N 50000 --seed 6 --radii 0.5 \
        --no-zero-level
    certify "$checkpoint" "$sigma" "$dir/grid_no_final_look.tsv" "${CPU_CERTIFY[@]}" --N 100000 --seed 3 --radii "${grid[@]}" \
        --no-final-look
    certify "$checkpoint" "$sigma" "$dir/certify_N100000.tsv" "${CPU_CERTIFY[@]}" --N 100000 --seed 0
    certify "$checkpoint" "$sigma" "$dir/certify_N10000.tsv" "${CPU_CERTIFY[@]}" --N 10000 --seed 1
    logs=("$dir/certify_N100000.tsv" "$dir/certify_N10000.tsv" "$dir/grid.tsv" "$dir/grid_no_final_look.tsv"
          "$dir/single_r0.5.tsv" "$dir/r0.5_alone.tsv" "$dir/r0.5_alone_N50000.tsv")
    if [ "$DRY_RUN" = 1 ]; then
        run "$PYTHON" tools/bench.py --sections g --grid-logs "${logs[@]}"
    else
        run "$PYTHON" tools/bench.py --sections g --grid-logs "${logs[@]}" --report "$dir/bench.txt"
    fi
done
