"""pipeline_map.onnx on real uploads beside the Python app: the same labels, the same map, and
what the map costs per upload.

    python bench/map_uploads.py --model models/vit-mnist --dev ../shared/realdigits-dev [--repeats 5]
    python bench/map_uploads.py --model RUN --photos FOLDER      # an RGB model on a photo folder
    python bench/map_uploads.py --model models/vit-mnist --mnist 200 --repeats 5   # 28x28 test digits

Every upload, read as the app reads it (EXIF-upright, at most the app's pixel limit), goes
through the Python app (the torch backend the app runs by default: `pictures.answer` with its
default head fusion and discard ratio, method rollout) and through pipeline_map.onnx in
onnxruntime (Python), fed the pixels Pillow decodes. Printed: how many labels agree, the
largest |graph map - app map| on the patch grid and how many uploads are within the export's
tolerance (1e-3), and refusals on either side.

`--mnist N` takes the first N MNIST test digits instead, each a decoded 28x28 upload: there the
canonicalisation is quick, so the network's and the map's share of the time shows.

With --repeats N it times, per upload (decoded pixels in, one thread, the median of N passes
over every upload, each upload through the routes in turn so a shared machine slows them alike):
pipeline.onnx (probabilities), pipeline_map.onnx asked for probabilities alone (what one graph
with both outputs would cost an app that wants only probabilities: onnxruntime runs every node
whatever it is asked for) and pipeline_map.onnx asked for every output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pipeline_uploads import images_of, upload  # noqa: E402
from vit_hub.demo.backends import TorchPredictor  # noqa: E402
from vit_hub.demo.pictures import answer  # noqa: E402
from vit_hub.explain.rollout import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION  # noqa: E402
from vit_hub.export.map_graph import MAP_OUTPUTS, MAP_TOLERANCE, run_map_pipeline  # noqa: E402
from vit_hub.export.pipeline_graph import decoded_pixels  # noqa: E402
from vit_hub.export.session import QUIET_RUN, quiet_session_options  # noqa: E402
from vit_hub.layout import PIPELINE_INPUT, PIPELINE_MAP, PIPELINE_OUTPUT, ExportLayout  # noqa: E402
from vit_hub.processing import canonical  # noqa: E402
from vit_hub.processing.preprocess import to_model_domain  # noqa: E402


def session_of(path: Path) -> ort.InferenceSession:
    options = quiet_session_options()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def app_answer(predictor: TorchPredictor, image) -> tuple[str, np.ndarray] | None:
    """The Python app's top label and rollout map, None where it refuses the upload."""
    try:
        view = to_model_domain(image, predictor.config)
    except canonical.EmptyImageError:  # no ink: the app refuses the upload
        return None
    result = answer(predictor, view, DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO, 1, "rollout")
    return next(iter(result.scores)), result.method_map


def graph_answer(session: ort.InferenceSession, image, labels: list[str]) -> tuple[str, np.ndarray] | None:
    try:
        got = run_map_pipeline(session, decoded_pixels(image))
    except Exception:  # onnxruntime's refusal (no ink)
        return None
    return labels[int(got[PIPELINE_OUTPUT].argmax())], got[PIPELINE_MAP]


def compare(model: Path, images: list) -> None:
    predictor = TorchPredictor.load(model)
    session = session_of(ExportLayout.for_model(model).pipeline_map)
    same_label, differences, refusals = 0, [], {"both": 0, "app only": 0, "graph only": 0}
    for image in images:
        app, graph = app_answer(predictor, image), graph_answer(session, image, predictor.config.labels)
        if app is None or graph is None:
            refusals["both" if app is graph else ("app only" if app is None else "graph only")] += 1
            continue
        same_label += app[0] == graph[0]
        differences.append(float(np.abs(app[1] - graph[1]).max()))
    answered = len(differences)
    print(f"{len(images)} uploads: labels equal the Python app's on {same_label}/{answered} answered; refused by "
          f"{refusals}")
    print(f"map: largest |graph - app| {max(differences):.2e}, median {statistics.median(differences):.2e}; "
          f"within {MAP_TOLERANCE:g} on {sum(d <= MAP_TOLERANCE for d in differences)}/{answered}")


def timings(model: Path, images: list, repeats: int) -> None:
    layout = ExportLayout.for_model(model)
    plain, with_map = session_of(layout.pipeline), session_of(layout.pipeline_map)
    pixels = [decoded_pixels(image) for image in images]
    routes = {"pipeline.onnx, probabilities": (plain, [PIPELINE_OUTPUT]),
              "pipeline_map.onnx, probabilities alone": (with_map, [PIPELINE_OUTPUT]),
              "pipeline_map.onnx, every output": (with_map, list(MAP_OUTPUTS))}
    spent = {name: [] for name in routes}
    for _ in range(repeats):
        passed = dict.fromkeys(routes, 0.0)
        for value in pixels:  # each upload through every route in turn: a busy moment slows them alike
            for name, (session, outputs) in routes.items():
                start = time.perf_counter()
                try:
                    session.run(outputs, {PIPELINE_INPUT: value}, QUIET_RUN)
                except Exception:
                    pass  # a refused upload costs what it cost
                passed[name] += time.perf_counter() - start
        for name, seconds in passed.items():
            spent[name].append(1000 * seconds / len(pixels))
    for name, values in spent.items():
        print(f"{name}: {statistics.median(values):.1f} ms per upload (median of {repeats} passes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dev")
    source.add_argument("--photos")
    source.add_argument("--mnist", type=int, help="the first N MNIST test digits, each a decoded 28x28 upload")
    parser.add_argument("--repeats", type=int, default=0, help="time the routes over N passes (0: no timing)")
    args = parser.parse_args()
    if args.mnist:
        from vit_hub.data.sources import load_splits
        test = load_splits("mnist", None).split("test")
        images = [test[index][0] for index in range(args.mnist)]
    else:
        images = [upload(path) for path, _, _ in images_of(args)]
    compare(args.model, images)
    if args.repeats:
        timings(args.model, images, args.repeats)


if __name__ == "__main__":
    main()
