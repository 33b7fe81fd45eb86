"""ONNX Runtime fp32 and fp16 against torch fp32, TF32 and bf16, side by side in one process.

    python bench/onnx_precision.py --preset small --batches 1,8,64,256         # ViT-S/16 on a GPU
    python bench/onnx_precision.py --model models/vit-mnist --batches 1,64 --threads 1   # a CPU

Exports the model (`--precision fp16`: model.onnx and model_fp16.onnx, verified), then times
every contender interleaved, round after round, at each batch size:

NumPy in, NumPy out, as an app calls `OnnxClassifier.run`: ONNX Runtime fp32 and fp16 on the
provider `auto` picks, torch fp32 and, on CUDA, torch TF32 and bf16 (autocast), copies between
host and device included. With the data already on the GPU (IO binding), and the fp16 graph's
forms against each other: bench/onnx_cuda.py.

Contenders a machine cannot run (CUDA ones on a CPU) are listed as not measured. Prints a
table (median ms per call, images/s) and this command; `--json` keeps the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vit_hub.export import OnnxClassifier, export_onnx  # noqa: E402
from vit_hub.export.timing import machine_load, time_interleaved  # noqa: E402
from vit_hub.hub.pretrained import HubVisionTransformer, load_model  # noqa: E402
from vit_hub.model.config import PRESETS  # noqa: E402

CUDA_ONLY = ("torch tf32", "torch bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model dir or Hub repo id")
    source.add_argument("--preset", choices=sorted(PRESETS), help="a preset with random weights (1000 classes)")
    parser.add_argument("--batches", default="1,8,64,256", help="comma-separated batch sizes")
    parser.add_argument("--threads", type=int, help="torch and onnxruntime CPU threads (default: their own choice)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per batch size")
    parser.add_argument("--block-seconds", type=float, default=0.3, help="time per contender per round")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 matrix products on or off for the duration (torch's default is off)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def torch_call(model: torch.nn.Module, pixels: np.ndarray, device: str, mode: str) -> Callable[[], np.ndarray]:
    """NumPy batch -> NumPy logits through torch in `mode`: fp32, tf32 or bf16 (autocast)."""
    def call() -> np.ndarray:
        autocast = torch.autocast(device, torch.bfloat16) if mode == "bf16" else contextlib.nullcontext()
        with torch.inference_mode(), tf32(mode == "tf32"), autocast:
            return model(torch.from_numpy(pixels).to(device)).logits.float().cpu().numpy()
    return call


def contenders(model: torch.nn.Module, classifiers: dict[str, OnnxClassifier], batch: int,
               device: str) -> dict[str, Callable[[], Any]]:
    config = model.config
    pixels = np.random.default_rng(0).normal(size=(batch, config.in_channels, *config.image_size)).astype(np.float32)
    calls: dict[str, Callable[[], Any]] = {f"ort {precision}": (lambda c=c: c.run(pixels))
                                           for precision, c in classifiers.items()}
    calls["torch fp32"] = torch_call(model, pixels, device, "fp32")
    if device == "cuda":
        calls["torch tf32"] = torch_call(model, pixels, device, "tf32")
        calls["torch bf16"] = torch_call(model, pixels, device, "bf16")
    return calls


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = (load_model(args.model) if args.model else HubVisionTransformer(**PRESETS[args.preset])).to(device).eval()
    batches = [int(batch) for batch in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        export_onnx(model.cpu(), folder, precision="fp16", eval_limit=256)  # verified, or it raises
        model.to(device)
        classifiers = {precision: OnnxClassifier(folder, precision=precision, threads=args.threads)
                       for precision in ("fp32", "fp16")}
        providers = {precision: classifier.providers[0] for precision, classifier in classifiers.items()}
        rows = []
        for batch in batches:
            calls = contenders(model, classifiers, batch, device)
            times = time_interleaved(calls, args.rounds, args.block_seconds)
            rows += [{"batch": batch, "contender": name, "ms": times[name]["wall_ms"],
                      "images_per_second": batch * 1e3 / times[name]["wall_ms"]} for name in calls]
            rows += [{"batch": batch, "contender": name, "ms": None} for name in CUDA_ONLY if name not in calls]
    report = {"command": shlex.join(["python", "bench/onnx_precision.py", *(argv or sys.argv[1:])]),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "ort_providers": providers,
              "torch": torch.__version__, **machine_load(), "rows": rows}
    print("| batch | contender | ms per call | images/s |\n|---|---|---|---|")
    for row in rows:
        shown = (f"{row['ms']:.2f} | {row['images_per_second']:.0f}" if row["ms"] is not None
                 else "not measured (needs CUDA) | -")
        print(f"| {row['batch']} | {row['contender']} | {shown} |")
    print(f"\n{report['command']}  # {report['device']}, ORT providers {providers}, load {report['load_average_1min']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
