"""pipeline_explain.onnx beside the torch page: what the page's opening map costs per upload when
ONNX Runtime computes it, and how close it is.

    python bench/explain_graph.py --model models/vit-mnist [--mnist 50] [--repeats 5] [--node] [--dev DIR]

The first N MNIST test digits, each a decoded 28x28 upload, go through pipeline_map.onnx
(rollout), pipeline_explain.onnx (the opening map, gradients inside) and the Python page's
opening map (`vit_hub.explain.run.explain` with the torch model, on the Python path's pixels).
Printed: labels agreeing, the largest |graph map - page map|, and per upload the median time
of each route over --repeats passes, one thread (ONNX Runtime's CPU provider, torch's CPU),
the routes interleaved per upload so a shared machine slows them alike. --node also times both
graphs in Node.js (examples/node's pinned onnxruntime-node, its CPU provider, one thread) on
the same decoded digits, after the Python routes. --dev compares the graph with the torch page on
real uploads in bench/real_uploads.py's layout, each decoded as the app decodes it (labels, the
largest |graph map - page map|, how many within 1e-3).
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
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vit_hub.data.sources import load_splits  # noqa: E402
from vit_hub.export.gradient_graph import graph_method, python_opening_map, run_explain_pipeline  # noqa: E402
from vit_hub.export.map_graph import run_map_pipeline  # noqa: E402
from vit_hub.export.pipeline_graph import decoded_pixels  # noqa: E402
from vit_hub.hub.pretrained import load_model  # noqa: E402
from vit_hub.layout import PIPELINE_MAP, PIPELINE_OUTPUT, ExportLayout  # noqa: E402
from vit_hub.processing.preprocess import to_model_domain  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
# Times each graph on each upload, interleaved per upload as the Python routes are: stdin gives
# {graphs: {name: path}, images: [{data, shape}], repeats}; stdout {name: [[ms per repeat] per upload]}.
NODE_TIMING = """
import * as ort from "onnxruntime-node";
import { readFileSync } from "node:fs";
const { graphs, images, repeats } = JSON.parse(readFileSync(0, "utf8"));
const options = { intraOpNumThreads: 1, interOpNumThreads: 1, executionProviders: ["cpu"] };
const sessions = {};
for (const [name, path] of Object.entries(graphs)) sessions[name] = await ort.InferenceSession.create(path, options);
const tensors = images.map(({ data, shape }) => new ort.Tensor("uint8", Uint8Array.from(data), shape));
const times = Object.fromEntries(Object.keys(sessions).map((name) => [name, tensors.map(() => [])]));
for (const session of Object.values(sessions)) await session.run({ image: tensors[0] }); // warm-up
for (let repeat = 0; repeat < repeats; repeat++) {
  for (const [index, image] of tensors.entries()) {
    for (const [name, session] of Object.entries(sessions)) {
      const started = performance.now();
      await session.run({ image });
      times[name][index].push(performance.now() - started);
    }
  }
}
console.log(JSON.stringify(times));
"""


def node_times(graphs: dict[str, Path], images: list, repeats: int) -> dict[str, float]:
    """{route: median ms per upload} of each graph in Node.js (onnxruntime-node, CPU provider, one thread)."""
    node = ROOT / "examples" / "node"
    sent = {"graphs": {name: str(Path(path).resolve()) for name, path in graphs.items()}, "repeats": repeats,
            "images": [{"data": pixels.ravel().tolist(), "shape": list(pixels.shape)}
                       for pixels in map(decoded_pixels, images)]}
    done = subprocess.run(["node", "--input-type=module", "-e", NODE_TIMING], input=json.dumps(sent), cwd=node,
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"node: expected the timings, got {done.stderr.strip().splitlines()[-1:]}")
    return {name: statistics.median(statistics.median(upload) for upload in per_upload)
            for name, per_upload in json.loads(done.stdout).items()}


def compare_dev(graph: ort.InferenceSession, model, method: str, dev: Path) -> None:
    """The graph against the torch page on each real upload, decoded as the app decodes it."""
    from bench.real_uploads import dev_images
    from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, load_image, open_image

    same, differences = 0, []
    images = dev_images(dev)
    for image in images:
        upload = load_image(open_image(image.path, image.path.name, UPLOAD_MAX_PIXELS))
        got = run_explain_pipeline(graph, decoded_pixels(upload))
        expected, label = python_opening_map(model, to_model_domain(upload, model.config), method)
        same += int(got[PIPELINE_OUTPUT].argmax()) == label
        differences.append(float(np.abs(got[PIPELINE_MAP] - expected).max()))
    print(f"{len(images)} real uploads ({dev}): labels {same}/{len(images)} equal, map max|diff| {max(differences):.1e}, "
          f"{sum(difference <= 1e-3 for difference in differences)}/{len(images)} within 1e-3")


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
    parser.add_argument("--node", action="store_true", help="also time both graphs in Node.js (onnxruntime-node)")
    parser.add_argument("--dev", type=Path, help="real uploads (bench/real_uploads.py's layout) to compare maps on")
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
    if args.dev:
        compare_dev(explain_graph, model, method, args.dev)
    if args.node:
        graphs = {"pipeline_map.onnx (rollout)": layout.pipeline_map, f"pipeline_explain.onnx ({method})":
                  layout.pipeline_explain}
        for name, median in node_times(graphs, images, args.repeats).items():
            print(f"Node.js {name}: {median:.1f} ms per upload (median, onnxruntime-node CPU provider, one thread)")


if __name__ == "__main__":
    main()
