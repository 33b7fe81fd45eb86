"""Validation vs shifted test: vit_hub's defaults against the defaults of another revision, a
naive plain ViT and a ResNet-18 from scratch, on the generated sets of bench/shifted_sets.py.

    python bench/shifted.py [--sets cells,shapes_tiny,objects_small,lighting]
                            [--rows defaults,reference,naive,resnet18] [--reference REV] [--scale 1.0]
                            [--epochs N] [--seed 0] [--data-seed 0] [--root DIR] [--out DIR]

Every row trains on a set's train split, selects its best epoch on a seeded, stratified
10 % of it (vit_hub's own `--val-split`, the same images for every row) and is scored on
the test split, which comes from a shifted acquisition the training images never show:
  defaults  `vit-hub train --data DIR --out OUT`, nothing else (plus --epochs and --seed
            when given);
  reference the same command on the code at `--reference REV` (a revision of this repository;
            BENCHMARKS.md names the ones measured), run unchanged from a git worktree (created
            at /tmp/vit_hub_reference if missing);
  naive     a plain ViT: conv patches, learned positions, no locality attention, no
            dropout or stochastic depth, no augmentation;
  resnet18  torchvision's ResNet-18 from scratch (bench-only, never used by vit_hub) at
            the defaults' input size, for the defaults' number of epochs and batch size
            (the same optimizer steps): AdamW (peak lr 1e-3) with warmup and cosine
            decay, random-resized crops, horizontal flips and colour jitter.
`--epochs` (default: each recipe's own) is given to every row. Children run with
OMP_NUM_THREADS=1. Writes OUT/results.json and OUT/results.md (a markdown table of
validation accuracy, shifted test accuracy and wall time) and each run under OUT/<set>/<row>.

    python bench/shifted.py resnet18 --data DIR --out OUT --epochs N --batch-size B --image-size S
                            [--seed 0] [--workers W] [--device auto]

trains the ResNet-18 row alone (this is how the benchmark runs it, in a child process).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from shifted_sets import GENERATORS  # noqa: E402  (bench/ is this script's own folder)

ROWS = ("defaults", "reference", "naive", "resnet18")
REFERENCE_TREE = Path("/tmp/vit_hub_reference")
NAIVE_FLAGS = ["--patch-embedding", "conv", "--no-locality-attention", "--pos-embedding", "learned",
               "--drop-path", "0", "--dropout", "0", "--augment", "none"]
VAL_SPLIT = 0.1  # vit_hub's default --val-split; the ResNet row holds out the same images
RESNET_CROP_SCALE = (0.35, 1.0)  # share of the image a random-resized crop keeps
RESNET_LR = 1e-3  # peak AdamW learning rate, whatever the batch size
ANNOUNCED = re.compile(r"training: (\d+) epochs, batch (\d+)")  # vit-hub train's summary line


# The ResNet-18 row -------------------------------------------------------------------------
class RGBPixels:
    """(PIL image, label) dataset -> (tensor, label): any mode converted to RGB, then `transform`.
    With `keep`, each decoded RGB image is kept (in each loader worker, across epochs) and
    later epochs transform the kept one: the same pixels, without decoding again (decoding a
    224-px JPEG is about half of this row's time per photo)."""

    def __init__(self, dataset, transform, keep: bool = False):
        self.dataset, self.transform, self.keep = dataset, transform, keep
        self.kept: dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if index in self.kept:
            image, label = self.kept[index]
        else:
            image, label = self.dataset[index]
            image = image.convert("RGB")
            if self.keep:
                self.kept[index] = (image, label)
        return self.transform(image), int(label)


def channel_stats(dataset, size: int, count: int = 500) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of up to `count` training images, resized to `size`, in [0, 1]."""
    import numpy as np
    from PIL import Image

    picks = np.random.default_rng(0).permutation(len(dataset))[:count]
    pixels = np.stack([np.asarray(dataset[int(i)][0].convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
                       for i in picks]).reshape(-1, 3) / 255.0
    return pixels.mean(0).tolist(), np.maximum(pixels.std(0), 1 / 255).tolist()


def resnet_transforms(size: int, mean: list[float], std: list[float]):
    """(training augmentation, evaluation transform), both ending in a normalised tensor."""
    import torch
    from torchvision.transforms import v2

    finish = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    train = v2.Compose([v2.ToImage(), v2.RandomResizedCrop((size, size), scale=RESNET_CROP_SCALE, antialias=True),
                        v2.RandomHorizontalFlip(), v2.ColorJitter(0.3, 0.3, 0.3, 0.1), *finish])
    evaluate = v2.Compose([v2.ToImage(), v2.Resize((size, size), antialias=True), *finish])
    return train, evaluate


def accuracy(model, loader, device, flips: bool = False) -> float:
    """Top-1 accuracy of a torchvision model (logits out) or a vit_hub one (a ViTOutput); `flips`
    (test-time flips): each image scored by the mean of its logits and its mirror image's."""
    import torch

    def logits_of(images):
        output = model(images.to(device))
        return getattr(output, "logits", output).float()

    model.eval()
    right = total = 0
    with torch.inference_mode():
        for images, labels in loader:
            logits = logits_of(images)
            if flips:  # the mirror image: width is the last axis of [B, C, H, W]
                logits = (logits + logits_of(images.flip(-1))) / 2
            predicted = logits.argmax(1).cpu()
            right += int((predicted == labels).sum())
            total += len(labels)
    return right / max(1, total)


def lr_factor(step: int, total: int, warmup_share: float = 0.05) -> float:
    """Share of the peak learning rate: linear warmup over 5 % of the steps, then cosine to 0."""
    warmup = max(1, round(warmup_share * total))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def train_resnet(data: str, out: Path, epochs: int, batch_size: int, image_size: int, seed: int,
                 workers: int | None = None, device: str = "auto") -> dict:
    """ResNet-18 from scratch, best epoch by validation accuracy, then scored on test (and
    with test-time flips; the last epoch's weights too, under `last`); writes OUT/metrics.json
    with the fields vit-hub train writes for the same numbers. `workers`: loader processes
    (default: vit_hub's CPU default)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torchvision.models import resnet18

    from vit_hub.data.batches import default_workers
    from vit_hub.data.sources import load_splits

    torch.manual_seed(seed)
    splits = load_splits(data, val_split=VAL_SPLIT, seed=seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    train_tf, eval_tf = resnet_transforms(image_size, *channel_stats(splits.train, image_size))
    workers = default_workers() if workers is None else workers
    train_loader = DataLoader(RGBPixels(splits.train, train_tf, keep=True), batch_size, shuffle=True, num_workers=workers,
                              drop_last=len(splits.train) >= batch_size, persistent_workers=workers > 0,
                              generator=torch.Generator().manual_seed(seed))
    eval_loaders = {name: DataLoader(RGBPixels(getattr(splits, name), eval_tf), 256)  # small: no workers
                    for name in ("val", "test")}
    model = resnet18(weights=None, num_classes=len(splits.labels)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=RESNET_LR, weight_decay=0.05)
    total = epochs * len(train_loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    best, best_state, history = -1.0, None, []
    for epoch in range(epochs):
        model.train()
        for images, labels in train_loader:
            with autocast:
                loss = F.cross_entropy(model(images.to(device)).float(), labels.to(device), label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        val = accuracy(model, eval_loaders["val"], device)
        history.append({"epoch": epoch + 1, "val_accuracy": val})
        if val > best:
            best, best_state = val, copy.deepcopy(model.state_dict())
    last = {"test": accuracy(model, eval_loaders["test"], device),
            "test_flips": accuracy(model, eval_loaders["test"], device, flips=True)}
    model.load_state_dict(best_state)
    test = accuracy(model, eval_loaders["test"], device)
    metrics = {"best_val_accuracy": best, "epochs": epochs, "batch_size": batch_size, "image_size": image_size,
               "history": history, "final": {"split": "test", "accuracy": test, "n": len(splits.test)},
               "test_flips": accuracy(model, eval_loaders["test"], device, flips=True), "last": last}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({"out": str(out), "test_accuracy": test, "best_val_accuracy": best}))
    return metrics


def resnet_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench/shifted.py resnet18", description="train the ResNet-18 row alone")
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--epochs", required=True, type=int)
    parser.add_argument("--batch-size", required=True, type=int)
    parser.add_argument("--image-size", required=True, type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, help="loader processes (default: vit_hub's CPU default)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu or cuda[:N]")
    args = parser.parse_args(argv)
    train_resnet(args.data, args.out, args.epochs, args.batch_size, args.image_size, args.seed, args.workers,
                 args.device)


# Running the rows -------------------------------------------------------------------------------
def reference_tree(revision: str) -> Path:
    """A worktree of the code at `revision`, made once and then reused."""
    if not REFERENCE_TREE.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(REFERENCE_TREE), revision],
                       check=True, capture_output=True)
    head, wanted = (subprocess.run(["git", "-C", str(tree), "rev-parse", rev], check=True, capture_output=True,
                                   text=True).stdout.strip() for tree, rev in ((REFERENCE_TREE, "HEAD"), (ROOT, revision)))
    if head != wanted:
        raise SystemExit(f"{REFERENCE_TREE} is at {head[:12]}, expected {revision} ({wanted[:12]}); remove it "
                         f"(git worktree remove {REFERENCE_TREE}) and run again")
    return REFERENCE_TREE


def chosen_budget(run: Path, log: Path) -> dict:
    """Epochs, batch size and input size of a finished run: a ResNet run's metrics hold them,
    a vit-hub run announces them in its log and keeps the size in its config."""
    metrics = json.loads((run / "metrics.json").read_text())
    if "batch_size" in metrics and "image_size" in metrics:
        return {key: metrics[key] for key in ("epochs", "batch_size", "image_size")}
    found = ANNOUNCED.search(log.read_text())
    if found is None:
        raise RuntimeError(f"{log}: expected vit-hub train's line 'training: N epochs, batch B', found none")
    size = json.loads((run / "config.json").read_text())["image_size"][0]
    return {"epochs": int(found.group(1)), "batch_size": int(found.group(2)), "image_size": size}


def default_budget(data: Path) -> dict:
    """Training photos, and the epochs, batch size and input size that vit_hub's defaults choose
    for `data`, computed without training (for a ResNet row run without the defaults row)."""
    from vit_hub.data.sources import describe_images, load_splits
    from vit_hub.model.config import suggest_for_data
    from vit_hub.train import schedule

    train_split = load_splits(str(data), val_split=VAL_SPLIT).train
    stats = describe_images(train_split)
    return {"train": len(train_split), "epochs": schedule.default_epochs(len(train_split)),
            "batch_size": schedule.default_batch_size(len(train_split)),
            "image_size": suggest_for_data(stats.num_train, stats.channels, stats.median_side)["image_size"]}


def row_command(row: str, data: Path, out: Path, args, budget: dict | None) -> tuple[list[str], Path, dict]:
    """(command, working directory, extra environment) of one row; `budget` is the defaults
    row's (None: not run in this invocation)."""
    shared = ["--seed", str(args.seed)] + (["--epochs", str(args.epochs)] if args.epochs else [])
    vit_hub_train = [sys.executable, "-m", "vit_hub", "train", "--data", str(data), "--out", str(out), *shared]
    if row == "defaults":
        return vit_hub_train, ROOT, {}
    if row == "naive":
        return vit_hub_train + NAIVE_FLAGS, ROOT, {}
    if row == "reference":
        tree = reference_tree(args.reference)
        return vit_hub_train, tree, {"PYTHONPATH": str(tree)}  # its package shadows this checkout's
    budget = budget or default_budget(data)
    command = [sys.executable, str(Path(__file__).resolve()), "resnet18", "--data", str(data), "--out", str(out),
               "--epochs", str(args.epochs or budget["epochs"]), "--batch-size", str(budget["batch_size"]),
               "--image-size", str(budget["image_size"]), "--seed", str(args.seed)]
    return command, ROOT, {}


def run_row(row: str, data: Path, out: Path, args, budget: dict | None) -> dict:
    """Train one row from scratch (its old run dir is replaced); its log is OUT.log."""
    if out.exists():
        shutil.rmtree(out)
    command, cwd, extra_env = row_command(row, data, out, args, budget)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    log = out.with_suffix(".log")
    started = time.perf_counter()
    with open(log, "w") as sink:
        returncode = subprocess.run(command, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    record = {"row": row, "seconds": round(seconds, 1), "command": " ".join(command), "log": str(log)}
    metrics_file = out / "metrics.json"
    if returncode or not metrics_file.is_file():
        return {**record, "error": f"exit code {returncode}; see {log}"}
    metrics = json.loads(metrics_file.read_text())
    test = metrics.get("final", {})
    return {**record, "val_accuracy": metrics["best_val_accuracy"],
            "test_accuracy": test.get("accuracy") if test.get("split") == "test" else None,
            **chosen_budget(out, log)}


def markdown(results: list[dict]) -> str:
    lines = ["| set | row | val accuracy | shifted test accuracy | test - val | epochs x batch, input | wall time |",
             "|---|---|---|---|---|---|---|"]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['set']} | {result['row']} | failed: {result['error']} | | | | |")
            continue
        val, test = result["val_accuracy"], result["test_accuracy"]
        budget = f"{result['epochs']} x {result['batch_size']}, {result['image_size']} px"
        lines.append(f"| {result['set']} | {result['row']} | {val:.3f} | {test:.3f} | {test - val:+.3f} | "
                     f"{budget} | {result['seconds']:.0f} s |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=",".join(GENERATORS), help="comma-separated, from: " + ", ".join(GENERATORS))
    parser.add_argument("--rows", help="comma-separated, from: " + ", ".join(ROWS) +
                        " (default: all, reference only with --reference)")
    parser.add_argument("--reference", metavar="REV", help="the revision the reference row runs")
    parser.add_argument("--scale", type=float, default=1.0, help="share of each set's full image counts")
    parser.add_argument("--epochs", type=int, help="given to every row (default: each recipe's own)")
    parser.add_argument("--seed", type=int, default=0, help="training seed of every row")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the generated sets")
    parser.add_argument("--root", type=Path, help="where the sets are generated (default: OUT/data)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/vit_hub_shifted"), help="runs, logs and results")
    args = parser.parse_args(argv)
    args.rows = args.rows or ",".join(row for row in ROWS if row != "reference" or args.reference)
    if "reference" in args.rows.split(",") and not args.reference:
        parser.error("--rows reference: expected --reference REV, the revision to run, got none")
    for option, chosen, known in (("--sets", args.sets, GENERATORS), ("--rows", args.rows, ROWS)):
        unknown = sorted(set(chosen.split(",")) - set(known))
        if unknown:
            parser.error(f"{option}: unknown {unknown}; expected some of {', '.join(known)}")
    args.out = args.out.resolve()
    args.root = (args.root or args.out / "data").resolve()
    return args


def main(argv: list[str]) -> None:
    if argv[:1] == ["resnet18"]:
        return resnet_main(argv[1:])
    args = parse_args(argv)
    rows = [row for row in ROWS if row in args.rows.split(",")]  # defaults first: resnet18 takes its budget
    results = []
    for name in args.sets.split(","):
        data = GENERATORS[name](args.root, args.data_seed, args.scale)
        (args.out / name).mkdir(parents=True, exist_ok=True)
        budget = None
        for row in rows:
            result = {"set": name, **run_row(row, data, args.out / name / row, args, budget)}
            if row == "defaults" and "error" not in result:
                budget = {key: result[key] for key in ("epochs", "batch_size", "image_size")}
            results.append(result)
            print(json.dumps(result), flush=True)
    table = markdown(results)
    header = (f"command: python bench/shifted.py {' '.join(argv)}\n"
              f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}, OMP_NUM_THREADS=1 per run\n")
    (args.out / "results.md").write_text(header + "\n" + table + "\n")
    (args.out / "results.json").write_text(json.dumps({"command": argv, "scale": args.scale, "epochs": args.epochs,
                                                       "seed": args.seed, "data_seed": args.data_seed,
                                                       "results": results}, indent=2) + "\n")
    print("\n" + header + "\n" + table)


if __name__ == "__main__":
    main(sys.argv[1:])
