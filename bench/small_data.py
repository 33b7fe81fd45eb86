"""Do the defaults beat a ResNet-18 from scratch on small real photo folders, whatever the seed?
Test accuracy over seeds, on every folder given, for the defaults (plain and with test-time
flips) and the ResNet-18 reference at the same input size, epochs and batch.

    python bench/small_data.py --data DIR [DIR ...] [--seeds 0 1 2] [--rows defaults resnet18]
                               [--jobs 1] [--workers 1] [--device auto] [--epochs N] [--subset N]
                               [--image-size N] [--vit-flags "FLAGS"] [--out DIR] [--runs DIR]

`--data`: folders with train/<class>/ and test/<class>/ (real photo folders such as
../shared/photos-dev/catsdogs and ../shared/photos-dev/flowers12, which stay outside the
project). Without it, a generated two-class "cell" set (`--train` and `--test` photos of 80-140
px) is written under OUT. `--subset N` trains on a copy of the first N training photos of each
class (and N/2 test photos), written under OUT: a smoke test, not a measurement.

Every (folder, row, seed) trains once, from scratch, in a child process with
OMP_NUM_THREADS=1 and `--workers` loader workers; `--jobs` of them run at a time (on one GPU
they share it), those that see the most photos first. The seed picks the validation split (a
stratified 10 % of train/), the initial weights and the augmentation:
  defaults   `vit-hub train --data DIR --out RUN --seed S` (plus --device, --workers and
             --epochs as given, and the flags of a candidate change: `--vit-flags`), the last
             epoch kept;
  resnet18   torchvision's ResNet-18 from scratch (bench-only: bench/shifted.py's row) at the
             input size, epochs and batch size the defaults choose for the folder (the same
             optimizer steps), its best epoch by validation accuracy, as BENCHMARKS.md's
             reference rows were measured; its last epoch beside it.
`--image-size N` gives both rows another input size: the ViT `--image-size N --patch-size N/8`
(the defaults' 8x8 token grid), the ResNet-18 N px, so a larger input is compared at equal size.
Every model is scored on the test split twice: as inference runs, and with test-time flips (the
mean of an image's logits and its mirror image's, bench/shifted.py's `accuracy`), which costs no
training.

Prints, and writes to OUT/results.md and OUT/results.json after every finished run (a bench cut
short leaves the tables of the runs done; each run's log is OUT/FOLDER/ROW-seedS.log, its model
dir under `--runs`), per folder each row's test accuracy per seed, its
mean, its spread (max - min, in points) and its mean's distance to the ResNet-18's (at its best
validation epoch, and at its last epoch: the stronger of the two on a folder is the bar), then per
run the validation accuracy, training accuracy and wall time.

    python bench/small_data.py vit-run ARGS...

is what runs a ViT row in its child: `vit-hub train ARGS...`, then the kept model scored on
validation and test with and without flips (RUN/flips.json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]  # the package, and bench/'s own modules when imported from tests
from shifted import accuracy, chosen_budget, default_budget  # noqa: E402  (bench/ is this script's own folder)
from small_cells import generated_cells  # noqa: E402

ROWS = ("defaults", "resnet18")
COST = {"defaults": 1.0, "resnet18": 1.1}  # rough cost per photo seen, to start the longest first
VAL_SPLIT = 0.1  # vit-hub train's default, which the ResNet row holds out alike
TOKEN_GRID = 8  # patches a side that the defaults choose on a small folder; --image-size keeps it


# A ViT row's child: train, then score the kept model with and without flips ---------------------
def vit_run(argv: list[str]) -> None:
    """`vit-hub train ARGV`, then RUN/flips.json: the kept model's val and test accuracy, plain
    and with test-time flips."""
    from vit_hub.cli import main as vit_hub_main

    code = vit_hub_main(["train", *argv])
    if code:
        raise SystemExit(code)
    parser = argparse.ArgumentParser()
    for flag in ("--data", "--out", "--seed", "--device"):
        parser.add_argument(flag)
    known, _ = parser.parse_known_args(argv)
    scores = flipped_scores(Path(known.out), known.data, int(known.seed or 0), known.device or "auto")
    (Path(known.out) / "flips.json").write_text(json.dumps(scores, indent=2) + "\n")


def flipped_scores(run: Path, data: str, seed: int, device: str) -> dict:
    import torch

    from vit_hub.data.batches import EvalTransform, Transformed, make_loader
    from vit_hub.data.sources import load_splits
    from vit_hub.hub.pretrained import load_model

    model = load_model(str(run))
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    model.to(device)
    splits = load_splits(data, None, VAL_SPLIT, seed)
    scores = {}
    for name in ("val", "test"):
        loader = make_loader(Transformed(splits.split(name), EvalTransform(model.config)), 256, shuffle=False,
                             seed=0, num_workers=0, pin_memory=False)
        for flips in (False, True):
            scores[name + ("_flips" if flips else "")] = accuracy(model, loader, device, flips)
    return scores


# The parent: which runs, in which order ---------------------------------------------------------
def run_command(row: str, data: Path, out: Path, seed: int, args, budget: dict) -> list[str]:
    epochs = str(args.epochs or budget["epochs"])
    if row == "resnet18":
        return [sys.executable, str(BENCH / "shifted.py"), "resnet18", "--data", str(data), "--out", str(out),
                "--epochs", epochs, "--batch-size", str(budget["batch_size"]),
                "--image-size", str(budget["image_size"]), "--seed", str(seed), "--workers", str(args.workers),
                "--device", args.device]
    extra = ["--epochs", str(args.epochs)] if args.epochs else []
    if args.image_size:
        extra += ["--image-size", str(args.image_size), "--patch-size", str(args.image_size // TOKEN_GRID)]
    return [sys.executable, str(BENCH / "small_data.py"), "vit-run", "--data", str(data), "--out", str(out),
            "--seed", str(seed), "--workers", str(args.workers), "--device", args.device, *extra,
            *shlex.split(args.vit_flags)]


def run(task: dict, args) -> dict:
    """Train one (folder, row, seed) from scratch into its run dir (an old one is replaced),
    logging to OUT/FOLDER/ROW-seedS.log."""
    out, log = task["out"], task["log"]
    if out.exists():
        shutil.rmtree(out)
    for folder in (out.parent, log.parent):
        folder.mkdir(parents=True, exist_ok=True)
    command = run_command(task["row"], task["data"], out, task["seed"], args, task["budget"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                         os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    with open(log, "w") as sink:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    record = {"folder": task["data"].name, "row": task["row"], "seed": task["seed"],
              "seconds": round(time.perf_counter() - started), "log": str(log)}
    if code or not (out / "metrics.json").is_file():
        return {**record, "error": f"exit code {code}; see {log}"}
    try:
        return {**record, **scores(task["row"], out, log)}
    except (OSError, KeyError, ValueError, RuntimeError) as error:  # one run's files, not the others' runs
        return {**record, "error": f"unreadable results ({type(error).__name__}: {error}); see {log}"}


def scores(row: str, out: Path, log: Path) -> dict:
    """Test accuracy (plain and with flips) and what else the tables show, from a finished run."""
    metrics = json.loads((out / "metrics.json").read_text())
    budget = chosen_budget(out, log)
    if row == "resnet18":
        val = metrics["best_val_accuracy"]
        return {"test": metrics["final"]["accuracy"], "test_flips": metrics["test_flips"],
                "last_test": metrics["last"]["test"], "last_test_flips": metrics["last"]["test_flips"],
                "val": val, **budget}
    flips = json.loads((out / "flips.json").read_text())
    return {"test": metrics["final"]["accuracy"], "test_flips": flips["test_flips"], "val": flips["val"],
            "train": metrics["history"][-1]["train_accuracy"], **budget}


def plan(folders: list[Path], args) -> list[dict]:
    """Every (folder, row, seed), each with the defaults' budget for its folder, longest first."""
    tasks = []
    for data in folders:
        budget = default_budget(data)
        if args.image_size:
            budget["image_size"] = args.image_size
        steps = (args.epochs or budget["epochs"]) * max(1, budget["train"] // budget["batch_size"])
        print(f"{data.name}: {budget['train']} training photos; {args.epochs or budget['epochs']} epochs x batch "
              f"{budget['batch_size']} at {budget['image_size']} px = {steps} steps a run", flush=True)
        for row in [row for row in ROWS if row in args.rows]:
            for seed in args.seeds:
                tasks.append({"data": data, "row": row, "seed": seed, "budget": budget, "steps": steps,
                              "photos": steps * budget["batch_size"], "out": args.runs / data.name / f"{row}-seed{seed}",
                              "log": args.out / data.name / f"{row}-seed{seed}.log"})
    tasks.sort(key=lambda task: -task["photos"] * COST[task["row"]])
    total = sum(task["steps"] for task in tasks)
    print(f"{len(tasks)} runs, {total} optimizer steps in all, "
          f"{args.jobs} at a time", flush=True)
    return tasks


# The tables ------------------------------------------------------------------------------------
TABLE_ROWS = (  # (label, run row, record key)
    ("ViT defaults", "defaults", "test"),
    ("ViT defaults, test-time flips", "defaults", "test_flips"),
    ("**ResNet-18 reference** (best validation epoch)", "resnet18", "test"),
    ("ResNet-18 reference, test-time flips", "resnet18", "test_flips"),
    ("ResNet-18 reference, last epoch", "resnet18", "last_test"),
    ("ResNet-18 reference, last epoch, test-time flips", "resnet18", "last_test_flips"),
)
REFERENCES = (("resnet18", "test"), ("resnet18", "last_test"))  # the ResNet-18 at its best validation epoch, and last


def row_values(results: list[dict], folder: str, row: str, key: str, seeds: list[int]) -> list[float | None]:
    found = {r["seed"]: r.get(key) for r in results if r["folder"] == folder and r["row"] == row and "error" not in r}
    return [found.get(seed) for seed in seeds]


def folder_table(results: list[dict], folder: str, seeds: list[int]) -> list[str]:
    references = [[v for v in row_values(results, folder, *reference, seeds) if v is not None]
                  for reference in REFERENCES]
    lines = [f"**{folder}** (test accuracy)", "",
             "| row | " + " | ".join(f"seed {seed}" for seed in seeds) +
             " | mean | spread (points) | mean - ResNet-18's, best validation epoch / last epoch (points) |",
             "|---|" + "---|" * (len(seeds) + 3)]
    for label, row, key in TABLE_ROWS:
        values = row_values(results, folder, row, key, seeds)
        done = [v for v in values if v is not None]
        if not done:
            continue
        mean = statistics.mean(done)
        gap = " / ".join(f"{100 * (mean - statistics.mean(reference)):+.1f}" for reference in references
                         if reference and len(done) == len(reference))
        lines.append(f"| {label} | " + " | ".join("" if v is None else f"{v:.3f}" for v in values) +
                     f" | **{mean:.3f}** | {100 * (max(done) - min(done)):.1f} | {gap} |")
    return lines


def detail_table(results: list[dict]) -> list[str]:
    lines = ["| folder | row | seed | val | train, last epoch | test | test, flips | epochs x batch, input | wall |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["folder"], ROWS.index(r["row"]), r["seed"])):
        if "error" in r:
            lines.append(f"| {r['folder']} | {r['row']} | {r['seed']} | failed: {r['error']} | | | | | |")
            continue
        train = f"{r['train']:.3f}" if "train" in r else ""
        lines.append(f"| {r['folder']} | {r['row']} | {r['seed']} | {r['val']:.3f} | {train} | {r['test']:.3f} | "
                     f"{r['test_flips']:.3f} | {r['epochs']} x {r['batch_size']}, {r['image_size']} px | "
                     f"{r['seconds']} s |")
    return lines


def write_results(results: list[dict], folders: list[Path], args, header: str) -> str:
    lines = [header, ""]
    for data in folders:
        lines += folder_table(results, data.name, args.seeds) + [""]
    lines += detail_table(results)
    text = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"command": sys.argv[1:], "header": header,
                                                       "results": results}, indent=2) + "\n")
    return text


def machine(args) -> str:
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    return (f"torch {torch.__version__}, {name}, {os.cpu_count()} CPU cores, {args.jobs} runs at a time, "
            f"{args.workers} loader worker(s) and OMP_NUM_THREADS=1 each")


# The command -----------------------------------------------------------------------------------
def subset(data: Path, out: Path, per_class: int) -> Path:
    """A copy of `data` with the first `per_class` training photos of each class and half as many test photos."""
    copy = out / f"{data.name}-subset{per_class}"
    if not copy.exists():
        for split, count in (("train", per_class), ("test", max(1, per_class // 2))):
            for folder in sorted((data / split).iterdir()):
                (copy / split / folder.name).mkdir(parents=True)
                for path in sorted(folder.iterdir())[:count]:
                    shutil.copyfile(path, copy / split / folder.name / path.name)
    return copy


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, nargs="+", help="folders with train/ and test/ (default: generated cells)")
    parser.add_argument("--train", type=int, default=400, help="generated training photos (without --data)")
    parser.add_argument("--test", type=int, default=200, help="generated test photos (without --data)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--epochs", type=int, help="given to every run (default: the defaults' own choice)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--workers", type=int, default=1, help="loader processes of each run")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N, for every run")
    parser.add_argument("--subset", type=int, metavar="N", help="train on N photos a class (a smoke test)")
    parser.add_argument("--image-size", type=int, metavar="N",
                        help=f"both rows at N px (the ViT with patches of N/{TOKEN_GRID}; default: the defaults' size)")
    parser.add_argument("--vit-flags", default="", metavar="FLAGS",
                        help='more `vit-hub train` flags for the ViT row, e.g. "--pos-embedding sincos"')
    parser.add_argument("--out", type=Path, default=Path("/tmp/vit_hub_small_data"), help="results and logs")
    parser.add_argument("--runs", type=Path, help="the runs' model dirs (default: OUT/runs)")
    args = parser.parse_args(argv)
    if args.image_size is not None and (args.image_size < TOKEN_GRID or args.image_size % TOKEN_GRID):
        parser.error(f"--image-size: expected a multiple of {TOKEN_GRID} of at least {TOKEN_GRID}, got {args.image_size}")
    args.out = args.out.resolve()
    args.runs = (args.runs or args.out / "runs").resolve()
    return args


def main(argv: list[str]) -> None:
    if argv[:1] == ["vit-run"]:
        return vit_run(argv[1:])
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    folders = ([path.resolve() for path in args.data] if args.data
               else [generated_cells(args.runs / f"cells{args.train}", args.train, args.test)])
    if args.subset:
        folders = [subset(data, args.runs / "subsets", args.subset) for data in folders]
    started = time.perf_counter()
    tasks = plan(folders, args)
    header = f"command: python bench/small_data.py {' '.join(argv)}\n{machine(args)}"
    results: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for done in concurrent.futures.as_completed([pool.submit(run, task, args) for task in tasks]):
            results.append(done.result())
            print(json.dumps(results[-1]), flush=True)
            write_results(results, folders, args, header + f"\n{len(results)} of {len(tasks)} runs done")
    wall = f"\nall {len(tasks)} runs in {time.perf_counter() - started:.0f} s"
    print("\n" + write_results(results, folders, args, header + wall))


if __name__ == "__main__":
    main(sys.argv[1:])
