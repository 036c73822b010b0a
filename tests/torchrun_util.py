"""Run a command under torchrun for a test; when it fails, the message shows every rank's own stderr.

torchrun's console output interleaves the ranks and, on a crash, ends with the launcher's summary: a rank's
own last words (an abort message, a traceback) can be far from the end. --tee 3 keeps each rank's stdout and
stderr in its own file under --log-dir as well, and failure_report() collects them.
"""
import glob
import os
import subprocess
import sys


def run_torchrun(script_and_args, log_dir, nproc=2, env=None, timeout=300):
    """torchrun --standalone --nproc_per_node nproc SCRIPT ARGS, logs of every rank under log_dir."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--log-dir", str(log_dir), "--tee", "3", *map(str, script_and_args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def failure_report(proc, log_dir, tail=3000):
    """The exit code, the launcher's stderr tail and, per rank, the tail of that rank's stderr.log."""
    import re
    parts = [f"exit code {proc.returncode}", "--- launcher stderr (tail) ---", proc.stderr[-tail:]]
    found = set()
    for path in sorted(glob.glob(os.path.join(str(log_dir), "**", "stderr.log"), recursive=True)):
        with open(path, errors="replace") as f:
            text = f.read()
        rank = os.path.basename(os.path.dirname(path))
        found.add(rank)
        parts += [f"--- rank {rank} stderr ({path}) ---", text[-tail:] or "(empty)"]
    # a rank without its file: its own lines from the console, where --tee prefixes them with [rank<r>]:
    for rank in sorted(set(re.findall(r"^\[(?:default)?(\d+)\]:", proc.stderr, flags=re.M)) - found):
        own = "\n".join(line.split(":", 1)[1] for line in proc.stderr.splitlines()
                        if re.match(rf"\[(?:default)?{rank}\]:", line))
        parts += [f"--- rank {rank} stderr (from the console) ---", own[-tail:] or "(empty)"]
    return "\n".join(parts)
