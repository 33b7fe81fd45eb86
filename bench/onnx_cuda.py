"""ONNX Runtime's CUDA provider against torch bf16 on the same GPU, device-resident, side by side.

    python bench/onnx_cuda.py [--model DIR] [--batches 1 64 256] [--rounds 7] [--json OUT]

Without --model: ViT-S/16 (the `small` preset, 224 px, 1000 classes) with random weights.
With --model: that model dir's weights (e.g. models/vit-mnist, the bundled model).

Contenders, all on one input already on the GPU, outputs left on the GPU (IO binding):
  * torch eager in bf16 autocast (`inference_mode`), and in float32;
  * ORT float32: model.onnx as `export_onnx` writes it (standard operators);
  * ORT float16, plain attention: that graph converted by `half.convert_to_fp16`;
  * ORT float16, fused attention alone: each block's attention one MultiHeadAttention node
    (export/fused_graph.py, step 1), then converted;
  * ORT float16 as shipped: model_fp16.onnx as `export_onnx(..., precision="fp16")` writes it,
    with ONNX Runtime's transformer fusions written in as well (fused_graph.py, step 2);
  * the same graph replayed as a CUDA graph (provider option `enable_cuda_graph`: the first run
    records every kernel launch of the fixed-shape batch, later runs replay the record in one
    launch). A graph ONNX Runtime cannot record (a node left on the CPU) is reported, not timed.
Every contender is timed round after round, interleaved (`timing.time_interleaved`, median per
call), each call ending when its outputs are ready (ORT's run returns then; torch is
synchronised). Agreement: each graph's top-1 against torch float32 on the timed batch, and
the largest logit difference. Needs onnxruntime-gpu and a CUDA GPU; refuses to run without.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vit_hub.export import export_onnx  # noqa: E402
from vit_hub.export.exporter import write_graph  # noqa: E402
from vit_hub.export.half import convert_to_fp16  # noqa: E402
from vit_hub.export.session import CUDA  # noqa: E402
from vit_hub.export.timing import time_interleaved  # noqa: E402
from vit_hub.hub.pretrained import load_model  # noqa: E402
from vit_hub.layout import GRAPH_INPUT, GRAPH_LOGITS, ExportLayout  # noqa: E402
from vit_hub.model.config import PRESETS  # noqa: E402
from vit_hub.model.vit import VisionTransformer  # noqa: E402

SHIPPED = "ort fp16 as shipped (fused + ORT fusions)"
SHIPPED_CUDA_GRAPH = "ort fp16 as shipped, CUDA graph replay"
EVAL_LIMIT = 256  # real images for the export's own fp16 agreement check (its report)


def load(reference: str | None) -> tuple[str, VisionTransformer]:
    if reference:
        return reference, load_model(reference)
    torch.manual_seed(0)
    model = VisionTransformer(**PRESETS["small"], num_classes=1000).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # the ViT init zeroes the head
    return "ViT-S/16 (small preset, 224 px, 1000 classes), random weights", model


def write_graphs(model: VisionTransformer, folder: Path) -> dict[str, Path]:
    """The graphs `--precision fp16` ships (written by export_onnx itself), and two float16
    graphs without its steps to hold them against."""
    shipped = export_onnx(model, folder / "model.onnx", precision="fp16", eval_limit=EVAL_LIMIT)
    fused = write_graph(model, folder / "fused.onnx", output_attentions=False, fused_attention=True)
    return {"ort fp32": shipped,
            "ort fp16, plain attention": convert_to_fp16(shipped, folder / "plain_fp16.onnx"),
            "ort fp16, fused attention alone": convert_to_fp16(fused, folder / "fused_fp16.onnx"),
            SHIPPED: ExportLayout.for_model(shipped).in_precision(shipped, "fp16")}


def ort_call(path: Path, pixels: torch.Tensor, classes: int, cuda_graph: bool = False):
    """A zero-argument call running the graph on `pixels` (on the GPU) into a GPU output; with
    `cuda_graph`, ONNX Runtime records the launches on the first run and replays them after."""
    options = {"device_id": pixels.device.index or 0, **({"enable_cuda_graph": "1"} if cuda_graph else {})}
    session = ort.InferenceSession(str(path), providers=[(CUDA, options)])
    if session.get_providers()[0] != CUDA:
        raise SystemExit(f"{path.name}: the CUDA provider did not start ({session.get_providers()})")
    logits = torch.empty(len(pixels), classes, device=pixels.device)
    binding = session.io_binding()
    binding.bind_input(GRAPH_INPUT, "cuda", 0, np.float32, list(pixels.shape), pixels.data_ptr())
    binding.bind_output(GRAPH_LOGITS, "cuda", 0, np.float32, list(logits.shape), logits.data_ptr())

    def call() -> torch.Tensor:
        session.run_with_iobinding(binding)
        return logits
    return call


def torch_call(model: VisionTransformer, pixels: torch.Tensor, dtype: torch.dtype | None):
    def call() -> torch.Tensor:
        with torch.inference_mode(), torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(pixels).logits
        torch.cuda.synchronize()
        return logits.float()
    return call


def measure(model: VisionTransformer, graphs: dict[str, Path], batch: int, rounds: int) -> dict[str, dict]:
    config = model.config
    generator = torch.Generator(device="cuda").manual_seed(batch)
    pixels = torch.randn(batch, config.in_channels, *config.image_size, device="cuda", generator=generator)
    calls = {"torch bf16": torch_call(model, pixels, torch.bfloat16), "torch fp32": torch_call(model, pixels, None)}
    calls.update({name: ort_call(path, pixels, config.num_classes) for name, path in graphs.items()})
    refused = {}
    try:
        calls[SHIPPED_CUDA_GRAPH] = ort_call(graphs[SHIPPED], pixels, config.num_classes, cuda_graph=True)
        calls[SHIPPED_CUDA_GRAPH]()  # the recording run, outside the timing
    except Exception as error:  # ONNX Runtime refuses graphs it cannot record: say why, time the rest
        refused[SHIPPED_CUDA_GRAPH] = {"refused": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        calls.pop(SHIPPED_CUDA_GRAPH, None)
    reference = calls["torch fp32"]().clone()
    results = time_interleaved(calls, rounds=rounds)
    for name, call in calls.items():
        logits = call().float()
        results[name]["top1_agreement_vs_torch_fp32"] = float((logits.argmax(1) == reference.argmax(1)).float().mean())
        results[name]["logits_max_abs_diff"] = float((logits - reference).abs().max())
    return {**results, **refused}


def gpu_description() -> str:
    name = torch.cuda.get_device_name()
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        driver = "unknown"
    return f"{name}, driver {driver}, torch {torch.__version__}, onnxruntime {ort.__version__}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model dir (default: ViT-S/16 with random weights)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or CUDA not in ort.get_available_providers():
        raise SystemExit("bench/onnx_cuda.py needs a CUDA GPU, torch with CUDA and onnxruntime-gpu")
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # the CUDA libraries torch's wheels installed
    described, model = load(args.model)
    model = model.eval()
    with tempfile.TemporaryDirectory() as folder:
        graphs = write_graphs(model, Path(folder))
        model.cuda()
        results = {batch: measure(model, graphs, batch, args.rounds) for batch in args.batches}
    print(f"{described}; {gpu_description()}")
    print(f"{'contender':40s}" + "".join(f"{f'batch {batch} ms':>16s}" for batch in args.batches) + "  top-1 agreement")
    for name in results[args.batches[0]]:
        rows = [results[batch][name] for batch in args.batches]
        if any("refused" in row for row in rows):
            print(f"{name:40s}  refused: {next(row['refused'] for row in rows if 'refused' in row)}")
            continue
        times = "".join(f"{row['wall_ms']:16.3f}" for row in rows)
        agreement = min(row["top1_agreement_vs_torch_fp32"] for row in rows)
        print(f"{name:40s}{times}  {agreement:.4f}")
    for batch in args.batches:
        for name in (SHIPPED, SHIPPED_CUDA_GRAPH):
            if "wall_ms" in results[batch][name]:
                ratio = results[batch]["torch bf16"]["wall_ms"] / results[batch][name]["wall_ms"]
                print(f"batch {batch}: {name} {ratio:.2f}x the speed of torch bf16")
    print("command: python " + shlex.join(["bench/onnx_cuda.py", *(argv if argv is not None else sys.argv[1:])]))
    if args.json:
        args.json.write_text(json.dumps({"model": described, "device": gpu_description(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
