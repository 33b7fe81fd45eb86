"""Do the defaults hold up on a small folder, whatever the seed? Test accuracy over several
seeds, beside a ResNet-18 from scratch at the same input size, epochs and batch.

    python bench/small_data.py [--data DIR | --train 400 --test 200] [--seeds 0 1 2]
                               [--rows defaults resnet18] [--epochs N] [--out DIR]

`--data DIR`: a folder with train/<class>/ and test/<class>/ (a real photo folder such as
../shared/photos-dev/catsdogs, which stays outside the project). Without it, a generated
two-class "cell" set (`--train` and `--test` photos of 80-140 px; class `parasitized` has a
few small dark inclusions) is written under OUT.

Every row trains once per seed, in a child process with OMP_NUM_THREADS=1, one at a time; the
seed picks the validation split (a stratified 10 % of train/), the initial weights and the
augmentation:
  defaults  `vit-hub train --data DIR --out OUT --seed S` and nothing else;
  naive     a plain ViT (16-px conv patches, ViT-Ti width, no augmentation, no regularisation,
            no small-data techniques) for the same epochs;
  resnet18  torchvision's ResNet-18 from scratch (bench-only; bench/shifted.py's row) at the
            input size, epochs and batch size the defaults chose (same optimizer steps), its
            best epoch by validation accuracy.
Prints, and writes to OUT/results.md and OUT/results.json, each row's test accuracy per seed,
its mean and its spread (max - min), and per seed the validation accuracy and the epoch whose
weights were kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
from shifted import chosen_budget, default_budget  # noqa: E402  (bench/ is this script's own folder)

ROWS = ("defaults", "naive", "resnet18")
NAIVE = ["--patch-size", "16", "--image-size", "64", "--embed-dim", "192", "--depth", "12", "--num-heads", "3",
         "--mlp-ratio", "4", "--patch-embedding", "conv", "--no-locality-attention", "--dropout", "0",
         "--drop-path", "0", "--augment", "none", "--label-smoothing", "0", "--weight-decay", "0"]


# The generated cell set ----------------------------------------------------------------------
def draw_cell(rng: np.random.Generator, infected: bool) -> Image.Image:
    size = int(rng.integers(80, 141))
    background = rng.integers(180, 240, 3)
    pixels = np.clip(background + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    radius_x, radius_y = size * rng.uniform(0.25, 0.4), size * rng.uniform(0.25, 0.4)
    centre = size / 2 + rng.uniform(-0.1, 0.1, 2) * size
    colour = tuple(int(c) for c in rng.integers([170, 90, 120], [230, 150, 190]))
    box = [centre[0] - radius_x, centre[1] - radius_y, centre[0] + radius_x, centre[1] + radius_y]
    draw.ellipse(box, fill=colour, outline=tuple(max(0, c - 40) for c in colour), width=2)
    if infected:
        for _ in range(int(rng.integers(1, 4))):
            angle, distance = rng.uniform(0, 2 * np.pi), rng.uniform(0, 0.6)
            x = centre[0] + np.cos(angle) * distance * radius_x
            y = centre[1] + np.sin(angle) * distance * radius_y
            dot = size * rng.uniform(0.04, 0.07)
            draw.ellipse([x - dot, y - dot, x + dot, y + dot], fill=tuple(int(c) for c in rng.integers(40, 90, 3)))
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2)))


def make_split(root: Path, count: int, rng: np.random.Generator) -> None:
    for index in range(count):
        label = "parasitized" if index % 2 else "uninfected"
        (root / label).mkdir(parents=True, exist_ok=True)
        draw_cell(rng, index % 2 == 1).save(root / label / f"{index:04d}.jpg", quality=90)


def generated_cells(root: Path, train: int, test: int) -> Path:
    if not root.exists():
        rng = np.random.default_rng(0)
        make_split(root / "train", train, rng)
        make_split(root / "test", test, rng)
    return root


# The runs ------------------------------------------------------------------------------------
def row_command(row: str, data: Path, out: Path, seed: int, epochs: int | None, budget: dict | None) -> list[str]:
    """The child's command; `budget` is the defaults' epochs, batch and input size for this seed."""
    if row == "resnet18":
        budget = budget or default_budget(data)
        return [sys.executable, str(BENCH / "shifted.py"), "resnet18", "--data", str(data), "--out", str(out),
                "--epochs", str(epochs or budget["epochs"]), "--batch-size", str(budget["batch_size"]),
                "--image-size", str(budget["image_size"]), "--seed", str(seed)]
    flags = (["--epochs", str(epochs)] if epochs else []) + (NAIVE if row == "naive" else [])
    if row == "naive" and not epochs:
        flags += ["--epochs", str((budget or default_budget(data))["epochs"])]
    return [sys.executable, "-m", "vit_hub", "train", "--data", str(data), "--out", str(out), "--seed", str(seed),
            *flags]


def run(row: str, data: Path, out: Path, seed: int, epochs: int | None, budget: dict | None) -> dict:
    """Train one row for one seed from scratch (an old run dir is replaced); its log is OUT.log."""
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command, log = row_command(row, data, out, seed, epochs, budget), out.with_suffix(".log")
    started = time.perf_counter()
    with open(log, "w") as sink:
        code = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=sink,
                              stderr=subprocess.STDOUT).returncode
    record = {"row": row, "seed": seed, "seconds": round(time.perf_counter() - started), "log": str(log)}
    if code or not (out / "metrics.json").is_file():
        raise SystemExit(f"{row}, seed {seed}: exit code {code}; see {log}")
    metrics = json.loads((out / "metrics.json").read_text())
    kept = metrics.get("kept", {}).get("epoch")
    val = next((r["val_accuracy"] for r in metrics["history"] if r["epoch"] == kept), metrics["best_val_accuracy"])
    return {**record, "test_accuracy": metrics["final"]["accuracy"], "val_accuracy": val, "kept_epoch": kept,
            **chosen_budget(out, log)}


def markdown(results: list[dict], seeds: list[int]) -> str:
    lines = ["| row | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean | spread (max - min) |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for row in dict.fromkeys(result["row"] for result in results):
        tests = [result["test_accuracy"] for result in results if result["row"] == row]
        lines.append(f"| {row} | " + " | ".join(f"{test:.3f}" for test in tests) +
                     f" | **{statistics.mean(tests):.3f}** | {max(tests) - min(tests):.3f} |")
    lines += ["", "| row | seed | val accuracy (kept epoch) | test accuracy | epochs x batch, input | wall time |",
              "|---|---|---|---|---|---|"]
    for result in results:
        kept = f"epoch {result['kept_epoch']}" if result["kept_epoch"] else "best epoch"
        lines.append(f"| {result['row']} | {result['seed']} | {result['val_accuracy']:.3f} ({kept}) | "
                     f"{result['test_accuracy']:.3f} | {result['epochs']} x {result['batch_size']}, "
                     f"{result['image_size']} px | {result['seconds']} s |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="folder with train/ and test/ (default: the generated cells)")
    parser.add_argument("--train", type=int, default=400, help="generated training photos (without --data)")
    parser.add_argument("--test", type=int, default=200, help="generated test photos (without --data)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=["defaults", "resnet18"])
    parser.add_argument("--epochs", type=int, help="given to every row (default: the defaults' own choice)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/vit_hub_small_data"), help="runs, logs and results")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    data = args.data.resolve() if args.data else generated_cells(out / f"cells{args.train}", args.train, args.test)
    results = []
    for seed in args.seeds:
        budget = None
        for row in [row for row in ROWS if row in args.rows]:  # defaults first: the others take its budget
            result = run(row, data, out / f"seed{seed}" / row, seed, args.epochs, budget)
            if row == "defaults":
                budget = {key: result[key] for key in ("epochs", "batch_size", "image_size")}
            results.append(result)
            print(json.dumps(result), flush=True)
    results.sort(key=lambda result: (ROWS.index(result["row"]), result["seed"]))
    header = (f"command: python bench/small_data.py {' '.join(argv)}\n"
              f"data: {data}; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}, "
              f"OMP_NUM_THREADS=1 per run\n")
    table = markdown(results, args.seeds)
    (out / "results.md").write_text(header + "\n" + table + "\n")
    (out / "results.json").write_text(json.dumps({"command": argv, "data": str(data), "results": results},
                                                 indent=2) + "\n")
    print("\n" + header + "\n" + table)


if __name__ == "__main__":
    main(sys.argv[1:])
