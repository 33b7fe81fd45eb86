"""pipeline_explain.onnx beside the torch page: what the page's opening map costs per upload when
ONNX Runtime computes it, and how close it is.

    python bench/explain_graph.py --model models/vit-mnist [--mnist 50] [--repeats 5]

The first N MNIST test digits, each a decoded 28x28 upload, go through pipeline_map.onnx
(rollout), pipeline_explain.onnx (the opening map, gradients inside) and the Python page's
opening map (`vit_hub.explain.run.explain` with the torch model, on the Python path's pixels).
Printed: labels agreeing, the largest |graph map - page map|, and per upload the median time
of each route over --repeats passes, one thread (ONNX Runtime's CPU provider, torch's CPU),
the routes interleaved per upload so a shared machine slows them alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vit_hub.data.sources import load_splits  # noqa: E402
from vit_hub.export.gradient_graph import graph_method, python_opening_map, run_explain_pipeline  # noqa: E402
from vit_hub.export.map_graph import run_map_pipeline  # noqa: E402
from vit_hub.export.pipeline_graph import decoded_pixels  # noqa: E402
from vit_hub.hub.pretrained import load_model  # noqa: E402
from vit_hub.layout import PIPELINE_MAP, PIPELINE_OUTPUT, ExportLayout  # noqa: E402
from vit_hub.processing.preprocess import to_model_domain  # noqa: E402


def one_thread_session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/vit-mnist")
    parser.add_argument("--mnist", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layout = ExportLayout.for_model(args.model)
    model = load_model(args.model)
    method = graph_method(layout.pipeline_explain)
    explain_graph, map_graph = one_thread_session(layout.pipeline_explain), one_thread_session(layout.pipeline_map)
    test = load_splits("mnist", None).split("test")
    images = [test[index][0] for index in range(args.mnist)]
    routes = {"pipeline_map.onnx (rollout)": lambda image: run_map_pipeline(map_graph, decoded_pixels(image)),
              f"pipeline_explain.onnx ({method})":
                  lambda image: run_explain_pipeline(explain_graph, decoded_pixels(image)),
              f"torch page ({method})": lambda image: python_opening_map(model, to_model_domain(image, model.config), method)}
    times = {name: [[] for _ in images] for name in routes}
    for _ in range(args.repeats):
        for index, image in enumerate(images):
            for name, route in routes.items():
                start = time.perf_counter()
                route(image)
                times[name][index].append(time.perf_counter() - start)
    same, worst = 0, 0.0
    for image in images:
        got = run_explain_pipeline(explain_graph, decoded_pixels(image))
        expected, label = python_opening_map(model, to_model_domain(image, model.config), method)
        same += int(got[PIPELINE_OUTPUT].argmax()) == label
        worst = max(worst, float(np.abs(got[PIPELINE_MAP] - expected).max()))
    print(f"{len(images)} MNIST test digits: labels {same}/{len(images)} equal, map max|diff| {worst:.1e}")
    for name, per_upload in times.items():
        median = statistics.median(statistics.median(upload) for upload in per_upload)
        print(f"{name}: {1000 * median:.1f} ms per upload (median, one thread)")


if __name__ == "__main__":
    main()
