"""CPU time per upload through `UploadClassifier`: this tree against a reference checkout, in one run.

    git worktree add /tmp/vit_hub_reference HEAD      # the code before the change measured
    flock -x /tmp/cpu.lock .venv/bin/python bench/upload_cpu.py --reference /tmp/vit_hub_reference \
        --model models/vit-mnist --uploads ../shared/realdigits-dev [--rounds 3] [--large 3]
    flock -x /tmp/cpu.lock .venv/bin/python bench/upload_cpu.py --reference /tmp/vit_hub_reference \
        --model RUN --photos ../shared/photos-dev/catsdogs/test          # a photo model (RGB, no canonicalisation)

Sets, each read where it lies (never copied):
  uploads  every image of --uploads (`<group>/<label>/<file>`, as bench/real_uploads.py), or
           of --photos (`<class>/<image>`);
  12 MP    --large 4000x3000 JPEGs written to --work: for a digit model, a bundled sample digit
           photographed on paper (lit unevenly, sensor noise), as bench/pipeline_uploads.py's
           --large; for a photo model, the first --large images of --photos enlarged.
Each revision runs in a child process of its own, with its tree first on the import path. It
opens `UploadClassifier(model, providers="cpu")` and, for every upload of a set, decodes the file
as that revision's classifier does (`UploadClassifier.decode` where the revision has it, else
`decoded_upload`, which decodes in full) and classifies it, one upload a call. The clock is the
child's CPU time (`time.process_time`: every thread of the process) over the set, divided by its
uploads, after one untimed pass; revisions alternate round by round and the medians of
--rounds are reported, with their ratio. `--work-side N` runs this tree with the digit
canonicalisation's ink-search plane (`canonical.WORK_SIDE`, 256) at N instead: what a smaller
plane would save and what it would move. Each child also gives its answers, and the Python
app's (the file read as that revision's app reads it: `open_image` with the model's
`decode_side` where the revision has one, `preprocess`, model.onnx, softmax): the table says
how many labels are equal between the revisions and the largest probability difference, and
what this tree's `preprocess` alone (canonical.py's NumPy, SciPy and Pillow for a digit model)
took per upload on the app's side (process CPU time, one pass, the median over the rounds).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LARGE = (4000, 3000)  # width, height: a 12-megapixel phone photo
SETS = ("uploads", "12 MP")


def uploads_of(args: argparse.Namespace) -> list[Path]:
    pattern = "*/*/*" if args.uploads else "*/*"
    folder = Path(args.uploads or args.photos)
    return sorted(path for path in folder.glob(pattern) if path.suffix.lower() in IMAGE_SUFFIXES)


def large_photos(args: argparse.Namespace, digit: bool, uploads: list[Path]) -> list[Path]:
    """--large 4000x3000 JPEGs in --work: a photographed digit each (a digit model), or photos enlarged."""
    from PIL import Image

    args.work.mkdir(parents=True, exist_ok=True)
    samples = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("*.png"))
    made = []
    for index in range(args.large):
        target = args.work / f"{'digit' if digit else 'photo'}_{index}.jpg"
        if digit:
            rng = np.random.default_rng(index)
            rows, cols = np.mgrid[0:LARGE[1], 0:LARGE[0]]
            paper = 215.0 - 60 * cols / LARGE[0] - 25 * rows / LARGE[1] + rng.normal(0, 3, rows.shape)
            ink = Image.open(samples[index % len(samples)]).convert("L").resize((1500, 1500), Image.Resampling.BICUBIC)
            paper[700:2200, 1200:2700] -= 0.7 * np.asarray(ink)
            picture = Image.fromarray(paper.clip(0, 255).astype(np.uint8)).convert("RGB")
        else:
            picture = Image.open(uploads[index]).convert("RGB").resize(LARGE, Image.Resampling.BICUBIC)
        picture.save(target, "JPEG", quality=90)
        made.append(target)
    return made


# The child: one revision -------------------------------------------------------------------------
def child(tree: str, model: str, paths: list[str], passes: int, work_side: int | None) -> dict:
    """CPU ms per upload through this revision's UploadClassifier (after an untimed pass), its
    answers, and its Python app's answers; `work_side` replaces canonical.WORK_SIDE (this tree only)."""
    sys.path.insert(0, tree)
    if work_side:
        from vit_hub.processing import canonical
        canonical.WORK_SIDE = work_side  # read when the graph is built and on each Python call
    from vit_hub.errors import UserError
    from vit_hub.export import batched_runtime
    from vit_hub.export.runtime import OnnxClassifier
    from vit_hub.processing import preprocess as pre
    from vit_hub.processing.postprocess import softmax

    with batched_runtime.UploadClassifier(model, providers="cpu") as classifier:
        decode = getattr(classifier, "decode", batched_runtime.decoded_upload)
        classify = lambda path: classifier.classify([decode(path)])[0]  # noqa: E731
        answers = [classify(path) for path in paths]  # the untimed pass
        started = time.process_time()
        for _ in range(passes):
            for path in paths:
                classify(path)
        cpu_ms = (time.process_time() - started) / (passes * len(paths)) * 1e3
    network = OnnxClassifier(model, providers="cpu", threads=1)
    side = pre.decode_side(network.config) if hasattr(pre, "decode_side") else None
    reduced = {"min_side": side} if side else {}  # the reference revision's open_image may not take it
    app, python_seconds = [], 0.0
    for path in paths:
        try:
            image = pre.load_image(pre.open_image(path, Path(path).name, pre.UPLOAD_MAX_PIXELS, **reduced))
            started = time.process_time()
            try:
                pixels = pre.preprocess(image, network.config)  # canonical.py's NumPy, SciPy and Pillow
            finally:
                python_seconds += time.process_time() - started
            logits = network.run(pixels[None])
            app.append(softmax(logits, network.config.temperature)[0].tolist())
        except UserError:  # a refusal (no ink)
            app.append(None)
    route = [None if answer.probabilities is None else answer.probabilities.tolist() for answer in answers]
    return {"cpu_ms": cpu_ms, "route": route, "app": app, "python_ms": python_seconds / len(paths) * 1e3}


def run_child(tree: Path, model: Path, paths: list[Path], passes: int, work_side: int | None = None) -> dict:
    command = [sys.executable, __file__, "--child", str(tree), "--model", str(model), "--passes", str(passes),
               *(["--work-side", str(work_side)] if work_side else []), *(str(path.resolve()) for path in paths)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"the child for {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.splitlines()[-1])


def input_change(paths: list[Path], sides: list[int]) -> list[str]:
    """A photo model's input (resized to each of `sides`, uint8) from the reduced decode against
    from the full decode of the same JPEGs: the largest and the mean |difference| in gray levels."""
    from vit_hub.model.config import ViTConfig
    from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, decode_side, load_image, open_image, resize

    lines = ["| model side | decoded at | largest abs difference (gray levels) | mean |", "|---|---|---|---|"]
    for side in sides:
        config = ViTConfig(image_size=side, patch_size=side // 8, embed_dim=64, depth=1, num_heads=2, num_classes=2)
        largest, means, sizes = 0, [], set()
        for path in paths:
            full = load_image(open_image(path, max_pixels=UPLOAD_MAX_PIXELS))
            reduced = load_image(open_image(path, max_pixels=UPLOAD_MAX_PIXELS, min_side=decode_side(config)))
            sizes.add(f"{reduced.width}x{reduced.height}")
            gap = np.abs(np.asarray(resize(full, config), np.int16) - np.asarray(resize(reduced, config), np.int16))
            largest, means = max(largest, int(gap.max())), means + [float(gap.mean())]
        lines.append(f"| {side} | {', '.join(sorted(sizes))} | {largest} | {statistics.mean(means):.2f} |")
        print(lines[-1], flush=True)
    return lines


# Comparing -------------------------------------------------------------------------------------
def agreement(ours: list, theirs: list) -> tuple[int, float]:
    """(labels equal, a refusal counting as a label; the largest probability difference)."""
    same = sum((a is None) == (b is None) and (a is None or int(np.argmax(a)) == int(np.argmax(b)))
               for a, b in zip(ours, theirs))
    differences = [float(np.abs(np.subtract(a, b)).max()) for a, b in zip(ours, theirs) if a is not None and b is not None]
    return same, max(differences, default=0.0)


def measure(args: argparse.Namespace, sets: dict[str, list[Path]]) -> list[str]:
    trees = {"reference": args.reference.resolve(), "this tree": ROOT}
    lines = ["| set | uploads | reference (CPU ms per upload) | this tree | ratio | labels equal (route) | "
             "max abs dp (route) | labels equal (app) | max abs dp (app) | app's preprocess (CPU ms, this tree) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, paths in sets.items():
        rounds: dict[str, list[dict]] = {tree: [] for tree in trees}
        for index in range(args.rounds):
            for tree in (list(trees) if index % 2 == 0 else list(trees)[::-1]):
                side = args.work_side if tree == "this tree" else None
                rounds[tree].append(run_child(trees[tree], args.model.resolve(), paths, args.passes, side))
        old, new = (statistics.median(result["cpu_ms"] for result in rounds[tree]) for tree in trees)
        route = agreement(rounds["this tree"][0]["route"], rounds["reference"][0]["route"])
        app = agreement(rounds["this tree"][0]["app"], rounds["reference"][0]["app"])
        python = statistics.median(result["python_ms"] for result in rounds["this tree"])
        lines.append(f"| {name} | {len(paths)} | {old:.1f} | {new:.1f} | {new / old:.2f} | {route[0]}/{len(paths)} | "
                     f"{route[1]:.2g} | {app[0]}/{len(paths)} | {app[1]:.2g} | {python:.1f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, help="a checkout of the revision to compare (git worktree add)")
    parser.add_argument("--model", type=Path, required=True, help="a model dir with model.onnx and config.json")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--uploads", help="digit uploads, <group>/<label>/<file>")
    source.add_argument("--photos", help="a photo folder, <class>/<image>")
    parser.add_argument("--large", type=int, default=3, help="12-megapixel JPEGs in the second set (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="child runs per revision and set (default 3)")
    parser.add_argument("--passes", type=int, default=1, help="timed passes over a set in each child (default 1)")
    parser.add_argument("--sides", type=int, nargs="+", default=[64, 224],
                        help="photo-model sides whose input change is measured (default 64 224)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vit_hub_upload_cpu"), help="where the 12 MP JPEGs go")
    parser.add_argument("--work-side", type=int, help="this tree's canonical.WORK_SIDE for the run (a what-if)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, str(args.model), args.paths, args.passes, args.work_side)))
        return
    if not args.reference or not (args.uploads or args.photos):
        parser.error("expected --reference and one of --uploads or --photos")
    uploads = uploads_of(args)
    digit = json.loads((args.model / "config.json").read_text()).get("canonicalize") == "digit"
    sets = {"uploads": uploads, "12 MP": large_photos(args, digit, uploads)}
    print(f"{args.model}: CPU ms per upload through UploadClassifier (decoding included), median of {args.rounds} rounds")
    measure(args, sets)
    if not digit:
        print(f"a photo model's input from {len(sets['12 MP'])} 12 MP JPEGs, decoded reduced against in full:")
        input_change(sets["12 MP"], args.sides)
    print("command: python " + shlex.join(["bench/upload_cpu.py", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    main()
