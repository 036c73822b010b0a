#!/usr/bin/env bash
# Training seeds 1 and 2 of the CPU-scale results (seed 0 is the committed run): a verdict about a training
# method needs its spread over seeds (docs/analysis.md, "Verdicts"; analyze.py compare). Resumable like its parts: a
# second call skips finished runs and continues the rest. Each seed of cifar_cpu.sh takes about 1.5 CPU-hours,
# each of table5_cpu.sh about 2.5.
#   bash scripts/seeds_cpu.sh            (SEEDS="1 2", PARTS="cifar table5")
# Writes results/cifar10_cpu/seed<S>/ and results/table5_cpu/seed<S>/ (runs under runs/*/seed<S>/).
source "$(dirname "$0")/help.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
for part in ${PARTS:-cifar table5}; do
    for s in ${SEEDS:-1 2}; do
        case $part in
            cifar)  RUNS=runs/cifar_cpu/seed$s OUT=results/cifar10_cpu/seed$s EXTRA_TRAIN="--seed $s" \
                        bash scripts/cifar_cpu.sh ;;
            table5) RUNS=runs/table5_cpu/seed$s LOGS=results/table5_cpu/seed$s/certify \
                        TABLES=results/table5_cpu/seed$s EXTRA_TRAIN="--seed $s" bash scripts/table5_cpu.sh ;;
            *) echo "seeds_cpu.sh: unknown part $part (cifar or table5)" >&2; exit 2 ;;
        esac
    done
done
