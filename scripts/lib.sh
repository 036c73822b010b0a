# Sourced by the experiment scripts (scripts/table3.sh, ...): their settings and three helpers.
#
# Environment (all optional):
#   DATA_DIR       dataset folder: CIFAR-10 (torchvision's files or train/ test/ image folders), or ImageNet's
#                  train/ and val/ (default $RS_DATA_DIR, else ./data)
#   RUNS           where run folders, certification logs and tables go (default runs/paper)
#   GPUS           processes per command; above 1, training and certification run under torchrun
#   EXTRA_TRAIN    flags added to every training command, e.g. "--epochs 1 --max-batches 2" for a smoke run
#   EXTRA_CERTIFY  flags added to every certify.py command, e.g. "--max 2 --N 100"
#   EXTRA_TARGET   flags added to the CAT-RS soft-label command (table3.sh, table4.sh), e.g. "--N 1"
#   DRY_RUN=1      print the commands (one "+ command" line each) without running them
#   PYTHON         the interpreter (default python3)
# A run folder holding a DONE file is trained already and skipped: put a released checkpoint.pth.tar and an
# empty DONE file there to certify it instead. One with a checkpoint but no DONE is resumed (--resume).
# Certification resumes by itself (certify.py continues an existing log written with the same settings).
source "$(dirname "${BASH_SOURCE[0]}")/help.sh"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
DATA_DIR=${DATA_DIR:-${RS_DATA_DIR:-data}}
RUNS=${RUNS:-runs/paper}
GPUS=${GPUS:-1}
DRY_RUN=${DRY_RUN:-0}
read -r -a EXTRA_TRAIN_ARGS <<< "${EXTRA_TRAIN:-}"
read -r -a EXTRA_CERTIFY_ARGS <<< "${EXTRA_CERTIFY:-}"
export PYTHONUNBUFFERED=1
if ! [[ "$GPUS" =~ ^[1-9][0-9]*$ ]]; then
    echo "$(basename "$0"): GPUS must be a whole number >= 1 (processes per command), not '$GPUS'" >&2
    exit 2
fi

# sigma_arg VALUE USAGE: VALUE if it is one of the paper's noise levels, else the usage line and exit 2 (a
# script's bad command line is one clear line, before anything runs).
sigma_arg() {
    case ${1:-} in
        0.25|0.5|1.0) echo "$1" ;;
        *) echo "usage: $2   (SIGMA: 0.25, 0.5 or 1.0${1:+; got '$1'})" >&2; exit 2 ;;
    esac
}

# run COMMAND...: print it (shell-quoted, after "+ "), then run it unless DRY_RUN=1.
run() {
    echo "+ $(printf '%q ' "$@")"
    if [ "$DRY_RUN" != 1 ]; then "$@"; fi
}

# train OUTDIR SCRIPT FLAGS...: train into OUTDIR with SCRIPT (under torchrun when GPUS > 1), resuming a
# partial run; a folder with a DONE file is skipped.
train() {
    local outdir=$1 script=$2
    shift 2
    if [ -f "$outdir/DONE" ]; then
        echo "= $outdir: trained already (DONE)"
        return
    fi
    local resume=()
    if [ -f "$outdir/checkpoint.pth.tar" ]; then resume=(--resume); fi
    local launch=("$PYTHON")
    if [ "$GPUS" -gt 1 ]; then launch=(torchrun --nproc_per_node "$GPUS"); fi
    run "${launch[@]}" "$script" --data-dir "$DATA_DIR" "$@" --outdir "$outdir" "${resume[@]}" \
        "${EXTRA_TRAIN_ARGS[@]}"
    if [ "$DRY_RUN" != 1 ]; then touch "$outdir/DONE"; fi
}

# certify CHECKPOINT SIGMA LOG FLAGS...: CERTIFY (N = 100,000, alpha = 0.001: certify.py's defaults, App.
# C.2) into LOG; rerunning resumes. Under torchrun, `--` keeps torchrun from reading certify's flags.
certify() {
    local checkpoint=$1 sigma=$2 log=$3
    shift 3
    local launch=("$PYTHON" certify.py)
    if [ "$GPUS" -gt 1 ]; then launch=(torchrun --nproc_per_node "$GPUS" certify.py --); fi
    run "${launch[@]}" --checkpoint "$checkpoint" --sigma "$sigma" --data-dir "$DATA_DIR" --outfile "$log" \
        "$@" "${EXTRA_CERTIFY_ARGS[@]}"
}


# default_root: the folder of certification logs to read: $ROOT where given; else $RUNS, or the paper's
# published logs ($PUBLISHED, default acr-weakness) where $RUNS has none (with a note).
PUBLISHED=${PUBLISHED:-acr-weakness}
default_root() {
    if [ -n "${ROOT:-}" ]; then return; fi
    ROOT=$RUNS
    if [ "$DRY_RUN" != 1 ] && [ ! -d "$RUNS/certify/cifar10" ] && [ -d "$PUBLISHED/certify/cifar10" ]; then
        echo "$(basename "$0"): no logs of ours in $RUNS/certify/cifar10 (make table3 makes them); using the" \
             "paper's published logs in $PUBLISHED" >&2
        ROOT=$PUBLISHED
    fi
}

# need FILE HINT: stop with a one-line error when FILE (made by another experiment) is missing.
need() {
    if [ "$DRY_RUN" != 1 ] && [ ! -e "$1" ]; then
        echo "$(basename "$0"): $1 is missing; $2" >&2
        exit 2
    fi
}

# keep_log RUN_DIR FILE: copy a finished run's training log (log.tsv, which read_train_log checks) beside the
# results it gave, through the output guard (never over a file this project did not write as such).
keep_log() {
    if [ "$DRY_RUN" != 1 ]; then
        "$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[3]); import machinery, readers
columns, (source, path) = readers.TRAIN_LOG_COLUMNS, sys.argv[1:3]
machinery.run(lambda: machinery.write_tsv(path, columns, [[r[c] for c in columns] for r in readers.read_train_log(
    source)], "training log copy", [source], now=False))' "$1/log.tsv" "$2" "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    fi
}
