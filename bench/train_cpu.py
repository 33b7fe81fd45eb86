"""`vit-hub train` end to end on a CPU-only machine: this tree against a reference revision, in one run.

    flock -x /tmp/cpu.lock python bench/train_cpu.py --reference REV --data ../shared/photos-dev/flowers12 \
        [--epochs 4] [--rounds 3] [--seed 0] [--work /tmp/vit_hub_train_cpu]

Each round trains once at each revision, the order turning every round, with the command a
person runs (`python -m vit_hub train --data DATA --out RUN --epochs E --seed S --device cpu`,
the defaults otherwise, OMP_NUM_THREADS=1) in a child process whose import path starts at that
revision's tree (the reference is a temporary `git worktree`). Two clocks per run: the wall
time, and the CPU time of the run and its loader workers (the children's rusage), which counts
only the cycles the run used and so is the steadier of the two on a shared machine. Reported:
the median of each over the rounds, the median of per-round ratios (this tree / reference), and
each run's last epoch's training and validation accuracy from its metrics (the same recipe;
the draws differ where the augmentation's implementation does).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_once(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """One `vit-hub train` at `tree`: wall and CPU seconds, and its last epoch's accuracies."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "vit_hub", "train", "--data", str(args.data), "--out", str(out),
               "--epochs", str(args.epochs), "--seed", str(args.seed), "--device", "cpu"]
    environment = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=environment, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"training at {tree} failed:\n{done.stderr[-2000:]}")
    last = json.loads((out / "metrics.json").read_text())["history"][-1]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "train_accuracy": last.get("train_accuracy"),
            "val_accuracy": last.get("val_accuracy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, metavar="REV", help="the vit_hub revision to compare with")
    parser.add_argument("--data", required=True, type=Path, help="a photo folder (train/ and test/, or classes)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vit_hub_train_cpu"))
    args = parser.parse_args()
    args.data = args.data.resolve()
    reference = Path(tempfile.mkdtemp(prefix="vit_hub_reference_"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(reference), args.reference],
                   check=True)
    trees = {args.reference: reference, "this tree": REPO}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for round_index in range(args.rounds):
            order = list(trees) if round_index % 2 == 0 else list(trees)[::-1]
            for name in order:
                runs[name].append(train_once(trees[name], args, args.work / "run"))
                print(f"round {round_index + 1}, {name}: {runs[name][-1]}", flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(reference)], check=False)
    report(runs, args)


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    old, new = runs[args.reference], runs["this tree"]
    print(f"\ncommand: python bench/train_cpu.py {' '.join(sys.argv[1:])}")
    print(f"{args.rounds} rounds, {args.epochs} epochs each, load average "
          f"{'/'.join(f'{value:.2f}' for value in os.getloadavg()[:2])} (1/5 min, at the end)\n")
    print("| | wall s (median) | CPU s (median) | last epoch train / val accuracy |")
    print("|---|---|---|---|")
    for name, results in runs.items():
        accuracies = ", ".join(f"{r['train_accuracy']:.3f} / {r['val_accuracy']:.3f}" for r in results)
        print(f"| {name} | {statistics.median(r['wall_s'] for r in results):.1f} | "
              f"{statistics.median(r['cpu_s'] for r in results):.1f} | {accuracies} |")
    for clock in ("wall_s", "cpu_s"):
        ratios = [b[clock] / a[clock] for a, b in zip(old, new)]
        print(f"\nthis tree / {args.reference}, {clock[:-2]}: median {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{ratio:.3f}' for ratio in ratios)})")


if __name__ == "__main__":
    main()
