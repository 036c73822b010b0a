#!/usr/bin/env bash
# Figures 3, 7 and 9 (and App. B.3's dominance orders): the ECDF of pA of every CIFAR-10 model, from the
# certification logs of Table 3.
#
# Usage: bash scripts/ecdf.sh                  (or: make ecdf; after make table3 SIGMA=0.25, 0.5 and 1.0;
#                                               without our logs, the published ones in $PUBLISHED if there)
#        ROOT=acr-weakness bash scripts/ecdf.sh          (the paper's published logs instead of ours)
# ROOT holds certify/cifar10/<method>/noise_<sigma>.tsv (default $RUNS); missing logs are left out. Writes
# $RUNS/figures/ecdf_cifar10/ (Figures 3 and 9: every method and sigma) and $RUNS/figures/figure7/ (sigma 1.0:
# Gaussian, Consistency, CAT-RS, ours). Other settings: scripts/lib.sh.
source "$(dirname "$0")/lib.sh"
default_root

# logs METHODS SIGMAS: the logs under ROOT that exist (all of them on a dry run), into the array `found`.
logs() {
    found=()
    for sigma in $2; do
        for method in $1; do
            local log=$ROOT/certify/cifar10/$method/noise_$sigma.tsv
            if [ "$DRY_RUN" = 1 ] || [ -f "$log" ]; then found+=("$log"); fi
        done
    done
    if [ ${#found[@]} = 0 ]; then
        echo "ecdf.sh: no logs $ROOT/certify/cifar10/<method>/noise_<sigma>.tsv; make them with make table3" \
             "SIGMA=... DATA_DIR=..., or point ROOT= at the paper's published logs (the data/ folder of" \
             "its repository)" >&2
        exit 2
    fi
}

logs "gaussian smoothadv macer consistency smoothmix catrs ours" "0.25 0.5 1.0"
run "$PYTHON" analyze.py ecdf "${found[@]}" --out "$RUNS/figures/ecdf_cifar10"
logs "gaussian consistency catrs ours" "1.0"
run "$PYTHON" analyze.py ecdf "${found[@]}" --out "$RUNS/figures/figure7"
