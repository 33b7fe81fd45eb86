"""A GPU server's routes for real uploads, on the CUDA and the CPU provider side by side.

    python bench/gpu_server.py --model models/vit-mnist --uploads ../shared/realdigits-dev \
        --providers cuda,cpu --out gpu_server.json

Routes, each on every provider asked for (--providers; a provider that does not start is
recorded as such, and the others still run):
  pipeline   pipeline.onnx, one upload a run (the whole path as one graph, float32);
  route      `UploadClassifier`: preprocessing graph on the CPU provider, network on the
             provider (with "auto" precision: the float16 copy on CUDA), one upload a call;
  batched    the same, all uploads in one call: preprocessed in worker threads, then one
             network run per --batch uploads.
The reference is the Python app (its ONNX backend): the upload read as the app reads it,
`preprocess`, model.onnx on the CPU provider in float32, softmax at the config's temperature.

Measured, written to --out as JSON and printed:
  labels       each route's labels against the reference on every upload (pipeline.onnx on
               CUDA: every --cuda-pipeline-every-th upload, since each new shape costs it about
               a second), and the largest probability difference (the batched route's also
               from the same uploads one at a time); on CUDA also the batched route in float32
               (TF32), to tell the float16 copy's part;
  fresh        ms per upload whose shape no session has seen (--fresh real uploads, each resized
               by a few pixels to a size used nowhere else in the run, routes interleaved):
               median and each;
  seen         ms per upload again at a shape already seen (median of three);
  large        ms for one 4000x3000 upload (a real one enlarged), at a fresh shape: decoded
               pixels in, and (route_from_jpeg) its JPEG's bytes decoded by
               UploadClassifier.decode, at the reduced scale the model needs;
  throughput   --batch uploads/s: batched (one call, a worker thread per core) against one at
               a time through the route (workers=1: onnxruntime's threads on one upload), and through
               pipeline.onnx (its shapes seen), each after one untimed pass; plus the network
               alone, one run of the batch against one run per upload.
`verdict` puts side by side a fresh upload through the route on CUDA against pipeline.onnx on
the CPU provider, and batched against one at a time on CUDA. About two minutes on a GPU
machine; needs onnxruntime (onnxruntime-gpu for CUDA), NumPy, Pillow, SciPy and onnx, never
torch. --uploads is `<group>/<label>/<file>` (MANIFEST.csv beside).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnxruntime as ort
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vit_hub.export.batched_runtime import UploadClassifier, available_cores, check_image, decoded_upload  # noqa: E402
from vit_hub.processing.preprocess import decode_side  # noqa: E402
from vit_hub.export.pipeline_graph import run_pipeline  # noqa: E402
from vit_hub.export.runtime import OnnxClassifier  # noqa: E402
from vit_hub.export.session import (ORT_ERRORS, ProviderFallbackError, provider_name, quiet_session_options,  # noqa: E402
                                    requested_providers)
from vit_hub.layout import ExportLayout  # noqa: E402
from vit_hub.processing.canonical import EmptyImageError  # noqa: E402
from vit_hub.processing.postprocess import softmax  # noqa: E402
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, load_image, open_image, preprocess  # noqa: E402

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LARGE = (4000, 3000)  # width, height: a 12-megapixel phone photo


class FreshShapes:
    """Uploads resized to sizes used nowhere else in this run, so no session has seen their shape."""

    def __init__(self) -> None:
        self.used: set[tuple[int, int]] = set()

    def __call__(self, pixels: np.ndarray, size: tuple[int, int] | None = None) -> np.ndarray:
        width, height = size or (pixels.shape[1], pixels.shape[0])
        while (width, height) in self.used:
            width, height = width + 1, height + 2
        self.used.add((width, height))
        image = Image.fromarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels)
        resized = np.asarray(image.resize((width, height), Image.Resampling.BILINEAR))
        return check_image(resized[..., None] if resized.ndim == 2 else resized)


def gpu_name() -> str | None:
    """The NVIDIA GPU's model as its driver names it (Linux), or None."""
    found = sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    lines = found[0].read_text().splitlines() if found else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model:")), None)


def dev_uploads(folder: Path) -> list[Path]:
    return sorted(path for path in folder.glob("*/*/*") if path.suffix.lower() in IMAGE_SUFFIXES)


def reference(model: Path, paths: list[Path]) -> list[np.ndarray | None]:
    """The Python app's probabilities per upload (None where it refuses: no ink)."""
    network = OnnxClassifier(model, providers="cpu", precision="fp32")
    answers = []
    for path in paths:
        try:
            upload = open_image(path, max_pixels=UPLOAD_MAX_PIXELS, min_side=decode_side(network.config))  # as the app
            pixels = preprocess(load_image(upload), network.config)
        except EmptyImageError:
            answers.append(None)
            continue
        answers.append(softmax(network.run(pixels[None]), network.config.temperature)[0])
    return answers


def agreement(got: list[np.ndarray | None], expected: list[np.ndarray | None]) -> dict[str, Any]:
    """How many labels (a refusal counts as a label) equal the reference's, and the largest probability difference."""
    same = sum((a is None and b is None) or (a is not None and b is not None and int(a.argmax()) == int(b.argmax()))
               for a, b in zip(got, expected))
    differences = [float(np.abs(a - b).max()) for a, b in zip(got, expected) if a is not None and b is not None]
    return {"uploads": len(got), "same_label_as_app": same, "max_probability_diff": max(differences, default=0.0)}


def milliseconds(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return 1000 * (time.perf_counter() - start)


def pipeline_probabilities(session: ort.InferenceSession, pixels: np.ndarray) -> np.ndarray | None:
    try:
        return run_pipeline(session, pixels)
    except ORT_ERRORS:  # a refusal (no ink)
        return None


def answers_of(classified) -> list[np.ndarray | None]:
    return [answer.probabilities for answer in classified]


class ProviderRun:
    """Every route on one provider."""

    def __init__(self, model: Path, provider: str, batch: int):
        self.provider = provider
        self.latency = UploadClassifier(model, providers=provider, strict=True, workers=1, batch_size=batch)
        self.server = UploadClassifier(model, providers=provider, strict=True, batch_size=batch)
        providers, _ = requested_providers(provider)
        self.pipeline = ort.InferenceSession(str(ExportLayout.for_model(model).pipeline), quiet_session_options(),
                                             providers=providers)
        if self.pipeline.get_providers()[0] != provider_name(providers[0]):
            raise ProviderFallbackError(f"pipeline.onnx: {provider_name(providers[0])} did not start")

    def describe(self) -> dict[str, Any]:
        return {"route_providers": self.server.providers, "route_precision": self.server.network.precision,
                "pipeline_providers": self.pipeline.get_providers(), "workers": self.server.workers}

    def labels(self, images: list[np.ndarray], expected: list, pipeline_every: int, model: Path) -> dict[str, Any]:
        """Each route's agreement with the app; for the batched route also its largest probability
        difference from the same uploads one at a time."""
        alone = [self.latency.classify([image])[0].probabilities for image in images]
        batched = answers_of(self.server.classify(images))
        found = {"route": agreement(alone, expected), "batched": agreement(batched, expected),
                 "pipeline": agreement([pipeline_probabilities(self.pipeline, image)
                                        for image in images[::pipeline_every]], expected[::pipeline_every])}
        found["batched"]["max_diff_from_one_at_a_time"] = agreement(batched, alone)["max_probability_diff"]
        if self.server.network.precision != "fp32":
            with UploadClassifier(model, providers=self.provider, strict=True, precision="fp32") as exact:
                found["batched_fp32"] = agreement(answers_of(exact.classify(images)), expected)
        return found

    def fresh(self, images: list[np.ndarray], fresh: FreshShapes) -> dict[str, Any]:
        """ms per upload at shapes never seen, per route (interleaved upload by upload): median and each."""
        routes = {"pipeline": lambda image: pipeline_probabilities(self.pipeline, image),
                  "route": lambda image: self.latency.classify([image])}
        timings = {name: [] for name in routes}
        for image in images:
            for name, run in routes.items():
                unseen = fresh(image)
                timings[name].append(round(milliseconds(lambda: run(unseen)), 2))
        return {name: {"median_ms": statistics.median(each), "each_ms": each} for name, each in timings.items()}

    def seen(self, images: list[np.ndarray]) -> dict[str, float]:
        routes = {"pipeline": lambda image: pipeline_probabilities(self.pipeline, image),
                  "route": lambda image: self.latency.classify([image])}
        result = {}
        for name, run in routes.items():
            for image in images:
                run(image)
            result[name] = statistics.median(statistics.median(milliseconds(lambda: run(image)) for _ in range(3))
                                             for image in images)
        return result

    def large(self, image: np.ndarray, fresh: FreshShapes) -> dict[str, float]:
        """ms for one upload enlarged to LARGE (at a size no session has seen), per route."""
        first, second, third = fresh(image, LARGE), fresh(image, LARGE), fresh(image, LARGE)
        stored = io.BytesIO()
        Image.fromarray(third[..., 0] if third.shape[-1] == 1 else third[..., :3]).save(stored, "JPEG", quality=90)
        return {"pipeline": milliseconds(lambda: pipeline_probabilities(self.pipeline, first)),
                "route": milliseconds(lambda: self.latency.classify([second])),
                "route_from_jpeg": milliseconds(lambda: self.latency.classify([self.latency.decode(stored.getvalue())]))}

    def throughput(self, images: list[np.ndarray], pipeline_images: list[np.ndarray]) -> dict[str, Any]:
        """uploads/s: the batch in one call against one upload a call (each after an untimed pass)."""
        calls = {"batched": lambda: self.server.classify(images),
                 "route_one_at_a_time": lambda: [self.latency.classify([image]) for image in images],
                 "pipeline_one_at_a_time": lambda: [pipeline_probabilities(self.pipeline, image)
                                                    for image in pipeline_images]}
        counts = {"batched": len(images), "route_one_at_a_time": len(images),
                  "pipeline_one_at_a_time": len(pipeline_images)}
        result = {}
        for name, call in calls.items():
            call()
            result[f"{name}_uploads_per_s"] = round(1000 * counts[name] / milliseconds(call), 1)
        pixel_values = np.concatenate([self.server.preprocess(image) for image in images])
        network = self.server.probabilities
        network(pixel_values), [network(row[None]) for row in pixel_values]
        result["network_batch_ms"] = milliseconds(lambda: network(pixel_values))
        result["network_one_at_a_time_ms"] = milliseconds(lambda: [network(row[None]) for row in pixel_values])
        return result

    def close(self) -> None:
        self.latency.close()
        self.server.close()


def measure(run: ProviderRun, images: list[np.ndarray], expected: list, fresh: FreshShapes,
            args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of one provider, labels first (they warm every session up)."""
    every = args.cuda_pipeline_every if run.provider == "cuda" else 1
    spread = images[::max(1, len(images) // args.fresh)][:args.fresh]
    report = {**run.describe(), "labels": run.labels(images, expected, every, args.model)}
    report["fresh"] = run.fresh(spread, fresh)
    report["seen_median_ms"] = run.seen(spread)
    report["large_ms"] = run.large(images[0], fresh)
    report["throughput"] = run.throughput(images[:args.batch], images[::every][:args.batch])
    return report


def verdict(providers: dict[str, Any]) -> dict[str, Any]:
    """The issue's two questions: a fresh upload through the route on CUDA against pipeline.onnx
    on the CPU provider (ms, median), and batched against one at a time on CUDA (uploads/s)."""
    cuda, cpu = providers.get("cuda", {}), providers.get("cpu", {})
    found = {}
    if "fresh" in cuda and "fresh" in cpu:
        found["fresh_ms_route_on_cuda_vs_pipeline_on_cpu"] = [cuda["fresh"]["route"]["median_ms"],
                                                              cpu["fresh"]["pipeline"]["median_ms"]]
    if "throughput" in cuda:
        rates = cuda["throughput"]
        found["cuda_batched_vs_one_at_a_time_uploads_per_s"] = [rates["batched_uploads_per_s"],
                                                                rates["route_one_at_a_time_uploads_per_s"]]
    return found


def summary(report: dict[str, Any]) -> str:
    """The JSON's main numbers as Markdown tables."""
    lines = ["| provider | route | same label as app | max prob diff | fresh upload ms (median) | seen ms | 4000x3000 ms |",
             "|---|---|---|---|---|---|---|"]
    for provider, found in report["providers"].items():
        if "error" in found:
            lines.append(f"| {provider} | did not run: {found['error']} | | | | | |")
            continue
        for route, labels in found["labels"].items():
            timed = route if route in found["fresh"] else None
            times = (f"{found['fresh'][timed]['median_ms']:.1f} | {found['seen_median_ms'][timed]:.1f} | "
                     f"{found['large_ms'][timed]:.0f}") if timed else " | | "
            lines.append(f"| {provider} | {route} | {labels['same_label_as_app']}/{labels['uploads']} | "
                         f"{labels['max_probability_diff']:.1e} | {times} |")
    lines += ["", "| provider | batched uploads/s | route one at a time | pipeline.onnx one at a time | "
              "network: batch ms | network: one at a time ms |", "|---|---|---|---|---|---|"]
    for provider, found in report["providers"].items():
        if "throughput" in found:
            t = found["throughput"]
            lines.append(f"| {provider} | {t['batched_uploads_per_s']} | {t['route_one_at_a_time_uploads_per_s']} | "
                         f"{t['pipeline_one_at_a_time_uploads_per_s']} | {t['network_batch_ms']:.1f} | "
                         f"{t['network_one_at_a_time_ms']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a model dir with pipeline.onnx and model.onnx")
    parser.add_argument("--uploads", type=Path, required=True, help="real uploads, <group>/<label>/<file>")
    parser.add_argument("--providers", default="cuda,cpu", help="comma-separated: cuda, cpu (default: cuda,cpu)")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--batch", type=int, default=64, help="uploads per batch for the throughput (default 64)")
    parser.add_argument("--fresh", type=int, default=12, help="uploads timed at fresh shapes (default 12)")
    parser.add_argument("--cuda-pipeline-every", type=int, default=9,
                        help="pipeline.onnx on CUDA scores every n-th upload only (default 9)")
    args = parser.parse_args()
    started = time.perf_counter()
    paths = dev_uploads(args.uploads)
    if not paths:
        parser.error(f"--uploads: expected images in <group>/<label>/<file>, found none in {args.uploads}")
    side = decode_side(OnnxClassifier(args.model, providers="cpu").config)  # as UploadClassifier.decode reads a file
    images, expected = [decoded_upload(path, side) for path in paths], reference(args.model, paths)
    fresh = FreshShapes()
    report = {"onnxruntime": ort.__version__, "gpu": gpu_name(), "available_providers": ort.get_available_providers(),
              "cpu_cores": available_cores(), "machine": platform.processor() or platform.machine(),
              "uploads": len(paths), "batch": args.batch, "providers": {}}
    for provider in args.providers.split(","):
        try:
            run = ProviderRun(args.model, provider, args.batch)
        except (ProviderFallbackError, *ORT_ERRORS) as error:
            report["providers"][provider] = {"error": str(error).splitlines()[0][:300]}
            continue
        try:
            report["providers"][provider] = measure(run, images, expected, fresh, args)
        except Exception as error:  # noqa: BLE001 - a provider failing mid-way is a result; the others still run
            report["providers"][provider] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        run.close()
        report.update(seconds=round(time.perf_counter() - started, 1), torch_imported="torch" in sys.modules,
                      verdict=verdict(report["providers"]))
        if args.out:  # after each provider, so a run cut short keeps what it measured
            args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"{provider}: done at {report['seconds']:.0f} s", flush=True)
    print(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
