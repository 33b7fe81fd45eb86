"""pipeline.onnx on real uploads, as an app in another language runs it, beside the Python path.

    python bench/pipeline_uploads.py --model models/vit-mnist --dev ../shared/realdigits-dev [--json OUT]
    python bench/pipeline_uploads.py --model RUN --photos FOLDER      # an RGB model on a photo folder
    python bench/pipeline_uploads.py --model models/vit-mnist --mnist   # the 10,000 MNIST test digits
    python bench/pipeline_uploads.py --model models/vit-mnist --large graph   # a 16 MP upload (or: python)

Every image is scored three ways:
  python  the app's path: the upload read as the app reads it (EXIF-upright, at most the app's
          pixel limit), `preprocess`, model.onnx, softmax (OnnxClassifier);
  graph   pipeline.onnx in onnxruntime (Python), fed the pixels Pillow decodes;
  node    examples/node/classify.mjs (onnxruntime-node and sharp, no Python): sharp decodes.
Printed: right answers per group (photo, painted) or, for a photo folder, per class; how often
each route's label equals the Python path's; and the time per image of the Python path and of
pipeline.onnx (the median of --repeats runs over every image, one thread each, decoding
excluded), so run it on a quiet machine.

`--mnist` scores the bundled MNIST test split instead, each digit as a decoded 28x28 upload, and
prints the accuracy of both paths and how often their labels agree (no timing).

`--large ROUTE` times one route on a 16-megapixel RGB photo of a digit on paper (the app's
largest upload) and prints the process's peak memory before and after it, one route a process.

`--dev` is a folder in bench/real_uploads.py's layout (`<group>/<label>/<owner>+<name>__<file>`);
`--photos` a folder `<class>/<image>` whose class names are the model's labels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_uploads import IMAGE_SUFFIXES, dev_images  # noqa: E402
from vit_hub.export.pipeline_graph import decoded_pixels, run_pipeline  # noqa: E402
from vit_hub.export.runtime import OnnxClassifier  # noqa: E402
from vit_hub.export.session import QUIET_RUN, quiet_session_options  # noqa: E402
from vit_hub.layout import GRAPH_INPUT, GRAPH_LOGITS, ExportLayout  # noqa: E402
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, load_image, open_image, preprocess  # noqa: E402

NODE_EXAMPLE = ROOT / "examples" / "node"


def images_of(args: argparse.Namespace) -> list[tuple[Path, str, str]]:
    """(path, group, label) of every image."""
    if args.dev:
        return [(image.path, image.group, image.label) for image in dev_images(Path(args.dev))]
    folder = Path(args.photos)
    return [(path, path.parent.name, path.parent.name) for path in sorted(folder.rglob("*"))
            if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES]


def upload(path: Path):
    """The image as the app reads an upload."""
    return load_image(open_image(path, path.name, UPLOAD_MAX_PIXELS))


def python_labels(model: Path, paths: list[Path]) -> list[str]:
    classifier = OnnxClassifier(model, providers="cpu", threads=1)
    labels = []
    for path in paths:
        try:
            labels.append(classifier.predict(upload(path), top_k=1)[0][0])
        except Exception as error:  # a refusal counts as no answer
            labels.append(f"refused: {error}")
    return labels


def graph_session(model: Path) -> ort.InferenceSession:
    options = quiet_session_options()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(ExportLayout.for_model(model).pipeline), options, providers=["CPUExecutionProvider"])


def graph_labels(model: Path, paths: list[Path], labels: list[str]) -> list[str]:
    session = graph_session(model)
    answers = []
    for path in paths:
        try:
            answers.append(labels[int(run_pipeline(session, decoded_pixels(upload(path))).argmax())])
        except Exception as error:
            answers.append(f"refused: {str(error).splitlines()[0][-120:]}")
    return answers


def node_labels(model: Path, paths: list[Path]) -> list[str]:
    result = subprocess.run(["node", "classify.mjs", str(model.resolve()), *(str(path.resolve()) for path in paths)],
                            cwd=NODE_EXAMPLE, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    return [row.get("label") or f"refused: {row['error'][-120:]}" for row in rows]


def timings(model: Path, paths: list[Path], repeats: int) -> dict[str, float]:
    """Median milliseconds per image: preprocess + model.onnx, and pipeline.onnx, decoded pixels in."""
    classifier = OnnxClassifier(model, providers="cpu", threads=1)
    session = graph_session(model)
    images = [upload(path) for path in paths]
    pixels = [decoded_pixels(image) for image in images]
    network = classifier.session
    routes = {"python": lambda index: network.run([GRAPH_LOGITS], {GRAPH_INPUT: preprocess(images[index], classifier.config)[None]},
                                                  QUIET_RUN),
              "graph": lambda index: run_pipeline(session, pixels[index])}
    spent = {name: [] for name in routes}
    for _ in range(repeats):
        for name, route in routes.items():
            start = time.perf_counter()
            for index in range(len(images)):
                try:
                    route(index)
                except Exception:
                    pass  # a refused image costs what it cost
            spent[name].append(1000 * (time.perf_counter() - start) / len(images))
    return {name: statistics.median(values) for name, values in spent.items()}


def score_mnist(model: Path) -> None:
    """MNIST test accuracy through the Python path and through pipeline.onnx, and their agreement."""
    from vit_hub.data.sources import load_splits

    test = load_splits("mnist", None).split("test")
    classifier, session = OnnxClassifier(model, providers="cpu", threads=1), graph_session(model)
    right = {"python": 0, "graph": 0}
    same = 0
    for index in range(len(test)):
        image, truth = test[index]
        python = int(classifier.run(preprocess(image, classifier.config)[None])[0].argmax())
        graph = int(run_pipeline(session, decoded_pixels(image)).argmax())
        right["python"] += python == truth
        right["graph"] += graph == truth
        same += python == graph
    count = len(test)
    print(f"MNIST test, {count} digits: python path {right['python'] / count:.4f}, pipeline.onnx "
          f"{right['graph'] / count:.4f}, same label {same}/{count}")


def time_large(model: Path, route: str) -> None:
    """One route on a 4000x4000 RGB phone photo: seconds, and the peak resident memory it added (both
    sessions are open before it starts)."""
    import resource

    rows, cols = np.mgrid[0:4000, 0:4000]
    paper = 215.0 - 60 * cols / 4000 - 25 * rows / 4000
    digit = Image.open(sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("*.png"))[0]).convert("L")
    paper[1200:2700, 1500:3000] -= 0.7 * np.asarray(digit.resize((1500, 1500), Image.Resampling.BICUBIC))
    photo = Image.fromarray(paper.clip(0, 255).astype(np.uint8)).convert("RGB")
    classifier, session = OnnxClassifier(model, providers="cpu", threads=1), graph_session(model)
    run = {"graph": lambda: run_pipeline(session, decoded_pixels(photo)),
           "python": lambda: classifier.run(preprocess(photo, classifier.config)[None])}[route]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    answer = run()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{route} on a 4000x4000 RGB upload: {seconds:.2f} s, peak memory {before:.0f} -> {after:.0f} MB "
          f"(label index {int(np.asarray(answer).argmax())})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model dir with pipeline.onnx and model.onnx")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dev", help="real digit uploads in bench/real_uploads.py's layout")
    source.add_argument("--photos", help="a photo folder <class>/<image>")
    source.add_argument("--mnist", action="store_true", help="the bundled MNIST test split")
    source.add_argument("--large", choices=("graph", "python"), help="one route on a 16 MP upload")
    parser.add_argument("--repeats", type=int, default=3, help="timing runs over every image (default 3)")
    parser.add_argument("--json", help="write per-image records here")
    args = parser.parse_args()
    model = Path(args.model)
    if args.mnist:
        return score_mnist(model)
    if args.large:
        return time_large(model, args.large)
    found = images_of(args)
    paths = [path for path, _, _ in found]
    classifier_labels = OnnxClassifier(model, providers="cpu").config.labels
    answers = {"python": python_labels(model, paths), "graph": graph_labels(model, paths, classifier_labels),
               "node": node_labels(model, paths)}
    groups = sorted({group for _, group, _ in found})
    print("| route | " + " | ".join(groups) + " | same label as python |")
    print("|---|" + "---|" * (len(groups) + 1))
    for route, labels in answers.items():
        right = [sum(label == truth for label, (_, group_of, truth) in zip(labels, found) if group_of == group)
                 for group in groups]
        totals = [sum(group_of == group for _, group_of, _ in found) for group in groups]
        same = sum(a == b for a, b in zip(labels, answers["python"]))
        print(f"| {route} | " + " | ".join(f"{r}/{t}" for r, t in zip(right, totals)) + f" | {same}/{len(found)} |")
    for route in ("graph", "node"):
        for (path, _, truth), mine, theirs in zip(found, answers[route], answers["python"]):
            if mine != theirs:
                print(f"{route} differs on {path.relative_to(path.parents[2])}: {mine} (python {theirs}, truth {truth})")
    per_image = timings(model, paths, args.repeats)
    print(f"ms per image, one thread, decoding excluded: python path {per_image['python']:.1f}, "
          f"pipeline.onnx {per_image['graph']:.1f} ({per_image['graph'] / per_image['python']:.2f}x)")
    if args.json:
        rows = [{"file": str(path), "group": group, "label": truth, **{route: answers[route][index] for route in answers}}
                for index, (path, group, truth) in enumerate(found)]
        Path(args.json).write_text(json.dumps({"rows": rows, "ms_per_image": per_image}, indent=1) + "\n")


if __name__ == "__main__":
    main()
