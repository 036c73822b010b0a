#!/usr/bin/env bash
# App. B.1 and Figure 8: the certified accuracy the sigma = 1.0 CIFAR-10 models of Figure 7 are expected to
# reach under another certification budget (N = 100, alpha = 0.01), read off their ECDF of pA (no inference).
#
# Usage: bash scripts/budget.sh                  (or: make budget; after make table3 SIGMA=1.0; without our
#                                                logs, the published ones in $PUBLISHED where present)
#        ROOT=acr-weakness N=1000 ALPHA=0.001 bash scripts/budget.sh
# ROOT holds certify/cifar10/<method>/noise_1.0.tsv (default $RUNS). Writes $RUNS/figures/budget_N<N>/.
# Other settings: scripts/lib.sh.
source "$(dirname "$0")/lib.sh"
default_root
N=${N:-100}
ALPHA=${ALPHA:-0.01}

logs=()
for method in gaussian consistency catrs ours; do
    log=$ROOT/certify/cifar10/$method/noise_1.0.tsv
    need "$log" "make it with make table3 SIGMA=1.0 DATA_DIR=..., or set ROOT to the paper's data folder"
    logs+=("$log")
done
run "$PYTHON" analyze.py budget --N "$N" --alpha "$ALPHA" "${logs[@]}" --out "$RUNS/figures/budget_N$N"
