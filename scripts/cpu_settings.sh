# Sourced by the CPU-scale experiments (scripts/cifar_cpu.sh, fig3_cpu.sh, table2_cpu.sh) after lib.sh: their
# one shortened CIFAR-10 schedule, their one certification, and each baseline's flags on that schedule.

# LeNet, lr 0.1, x0.1 after 6 of 10 epochs (the paper: 150 epochs, x0.1 every 50).
CPU_SCHEDULE=(--dataset cifar10 --arch lenet --lr_step 6 --epochs 10 --workers 0 --amp --channels-last)
# Every 20th test image (500) with N = 10,000 (the paper: every 20th, N = 100,000), alpha = 0.001.
CPU_CERTIFY=(--dataset cifar10 --N 10000 --alpha 0.001 --skip 20 --batch 1000 --precision bf16)

# method_flags METHOD: set FLAGS to METHOD's train_baselines.py flags here, the released settings changed only
# where time forces it (why each: the header of scripts/fig3_cpu.sh). A loss probed by --gradnorm takes the
# same flags as its training.
method_flags() {
    case $1 in
        smoothadv) FLAGS=(--T 2 --warmup 4) ;;
        smoothmix) FLAGS=(--warmup 1) ;;
        macer)     FLAGS=(--deferred) ;;
        catrs)     FLAGS=(--catrs-target "$RUNS/catrs_target.pt") ;;
        *)         FLAGS=() ;;
    esac
}
