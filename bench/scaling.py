"""CPU training throughput with 1 and 2 processes (torchrun + gloo), same global batch.

    python bench/scaling.py [--epochs 2] [--images 1024]

Runs `vit-hub train` on a generated image folder once as a single process and once under
`torchrun --nproc_per_node 2`, and reads the images/s each epoch recorded in metrics.json
(the last epoch counts, so start-up is excluded). On a 2-core machine two processes
cannot beat one: the point is correctness and the size of the overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

FLAGS = ["--preset", "mnist", "--in-channels", "1", "--batch-size", "128", "--workers", "0",
         "--augment", "none", "--val-split", "0.1"]


def make_folder(root: Path, images: int) -> None:
    """Ten classes of random 28x28 grayscale images (content does not matter for speed)."""
    rng = np.random.default_rng(0)
    for index in range(images):
        folder = root / str(index % 10)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(folder / f"{index}.png")


def run(processes: int, data: Path, out: Path, epochs: int) -> float:
    launcher = [sys.executable, "-m", "vit_hub"] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
        "-m", "vit_hub"]
    command = [*launcher, "train", "--data", str(data), "--out", str(out), "--epochs", str(epochs), *FLAGS]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return json.loads((out / "metrics.json").read_text())["history"][-1]["images_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--images", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        make_folder(data, args.images)
        rates = {n: run(n, data, Path(scratch) / f"out{n}", args.epochs) for n in (1, 2)}
    print(f"command: python bench/scaling.py --epochs {args.epochs} --images {args.images}")
    print(f"load average at end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    print("| processes | images/s | vs 1 process |")
    print("|---|---|---|")
    for processes, rate in rates.items():
        print(f"| {processes} | {rate:.0f} | {rate / rates[1]:.2f}x |")


if __name__ == "__main__":
    main()
