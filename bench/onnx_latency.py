"""ONNX Runtime (CPU) against torch eager on one model, side by side in one process.

    python bench/onnx_latency.py --model models/vit-mnist --threads 2

Exports the model with both torch exporters (TorchScript and dynamo), the attentions graph
and the int8 graph (accuracy on the --calib-data test split comes from the export report),
then times every contender interleaved, round after round, at batch 1 (latency) and batch
256 (throughput), on two clocks: wall time and process CPU time (with --threads 1 the CPU
clock is robust to other processes sharing the cores). Also times the model's Linear
shapes alone in fp32 and int8: the most dynamic quantization can gain on this CPU.
Prints a table, the ratios against the speed targets and this command.
Without --model (or when the folder has no weights) the `mnist` preset with random weights
is timed, and its int8 accuracy means nothing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vit_hub.export import OnnxClassifier, export_onnx  # noqa: E402
from vit_hub.export.quantize import quantize_int8  # noqa: E402
from vit_hub.export.session import CPU, create_session  # noqa: E402
from vit_hub.export.timing import machine_load, time_interleaved  # noqa: E402
from vit_hub.hub.pretrained import load_model  # noqa: E402
from vit_hub.layout import ExportLayout  # noqa: E402
from vit_hub.model.config import PRESETS  # noqa: E402
from vit_hub.model.vit import VisionTransformer  # noqa: E402

BATCHES = (1, 256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model dir or Hub repo id (default: mnist preset, random weights)")
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per batch size")
    parser.add_argument("--block-seconds", type=float, default=0.3, help="time per contender per round")
    parser.add_argument("--calib-data", default="mnist", help="test split for the int8 accuracy")
    parser.add_argument("--eval-limit", type=int, help="int8 accuracy on the first N test images only")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def load(reference: str | None) -> tuple[str, VisionTransformer]:
    if reference and (not Path(reference).is_dir() or (Path(reference) / "model.safetensors").is_file()):
        return reference, load_model(reference)
    torch.manual_seed(0)
    model = VisionTransformer(**PRESETS["mnist"]).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # the ViT init zeroes the head
    return "mnist preset, random weights", model


def export_all(model: VisionTransformer, folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """TorchScript logits + attentions + int8 graphs, and the dynamo logits graph."""
    torchscript = export_onnx(model, folder / "torchscript" / "model.onnx", output_attentions=True, quantize="int8",
                              calib_data=args.calib_data, eval_limit=args.eval_limit)
    dynamo = export_onnx(model, folder / "dynamo" / "model.onnx", exporter="dynamo")
    layout = ExportLayout.for_model(torchscript)
    return {"torchscript": torchscript, "dynamo": dynamo, "int8": layout.int8, "attentions": layout.attentions,
            "report": layout.report}


def contenders(model: VisionTransformer, paths: dict[str, Path], pixels: np.ndarray, threads: int) -> dict:
    """Zero-argument calls, one per contender, all on the same input."""
    sessions = {name: OnnxClassifier(paths[name], providers="cpu", threads=threads)
                for name in ("torchscript", "dynamo", "int8")}
    attentions = OnnxClassifier(paths["torchscript"], providers="cpu", threads=threads)
    combined = OnnxClassifier(paths["attentions"], providers="cpu", threads=threads)  # one graph, both outputs
    tensor = torch.from_numpy(pixels)

    def torch_eager():
        with torch.inference_mode():
            model(tensor)

    calls = {"torch eager": torch_eager}
    calls.update({f"ort {name}": (lambda s=session: s.run(pixels)) for name, session in sessions.items()})
    calls["ort torchscript +attentions"] = lambda: attentions.run(pixels, output_attentions=True)
    calls["ort attentions graph, logits"] = lambda: combined.run(pixels)  # fetching logits only
    return calls


def measure(model: VisionTransformer, paths: dict[str, Path], args: argparse.Namespace) -> dict[int, dict]:
    config = model.config
    results = {}
    for batch in BATCHES:
        pixels = np.random.default_rng(0).normal(size=(batch, config.in_channels, *config.image_size)).astype(np.float32)
        results[batch] = time_interleaved(contenders(model, paths, pixels, args.threads), args.rounds,
                                          args.block_seconds)
    return results


def matmul_graph(rows: int, inputs: int, outputs: int, path: Path) -> Path:
    """One MatMul [rows, inputs] x weights [inputs, outputs], as the model's Linear layers run."""
    weights = numpy_helper.from_array(np.random.default_rng(0).normal(0, 0.05, (inputs, outputs)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["pixel_values", "w"], ["logits"])], "linear",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [rows, inputs])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [rows, outputs])], [weights])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)
    return path


def matmul_speedups(model: VisionTransformer, folder: Path, args: argparse.Namespace) -> dict[str, dict]:
    """int8 over fp32 for the model's four Linear shapes alone, at batch 256: the ceiling
    dynamic quantization can reach on this CPU, whatever the rest of the graph costs."""
    config = model.config
    dim, hidden, rows = config.embed_dim, int(config.embed_dim * config.mlp_ratio), 256 * config.num_tokens
    speedups = {}
    for name, (inputs, outputs) in {"qkv": (dim, 3 * dim), "attention out": (dim, dim),
                                    "mlp in": (dim, hidden), "mlp out": (hidden, dim)}.items():
        fp32 = matmul_graph(rows, inputs, outputs, folder / f"{name}.onnx".replace(" ", "_"))
        int8 = quantize_int8(fp32, fp32.with_name(f"{fp32.stem}_int8.onnx"))
        sessions = {kind: create_session(path, [CPU], args.threads) for kind, path in (("fp32", fp32), ("int8", int8))}
        x = np.random.default_rng(1).normal(size=(rows, inputs)).astype(np.float32)
        times = time_interleaved({kind: (lambda s=session: s.run(None, {"pixel_values": x}))
                                  for kind, session in sessions.items()}, args.rounds, args.block_seconds / 3)
        speedups[f"{name} [{rows}x{inputs}]x[{inputs}x{outputs}]"] = {
            clock: times["fp32"][clock] / times["int8"][clock] for clock in ("wall_ms", "cpu_ms")}
    return speedups


def table(results: dict[int, dict]) -> list[str]:
    lines = [f"{'batch':>5}  {'contender':<28} {'wall ms':>9} {'cpu ms':>9} {'img/s':>8} {'vs torch':>9}"]
    for batch, times in results.items():
        torch_ms = times["torch eager"]["wall_ms"]
        for name, row in times.items():
            lines.append(f"{batch:>5}  {name:<28} {row['wall_ms']:>9.3f} {row['cpu_ms']:>9.3f} "
                         f"{1e3 * batch / row['wall_ms']:>8.0f} {row['wall_ms'] / torch_ms:>8.2f}x")
    return lines


def ratios(results: dict[int, dict], clock: str) -> dict[str, float]:
    """The speed targets, as measured on one clock ("wall_ms" or "cpu_ms")."""
    small, large = results[1], results[256]

    def ratio(times, numerator, denominator):
        return times[numerator][clock] / times[denominator][clock]

    return {
        "batch-1 latency ORT / torch (target <= 0.4)": ratio(small, "ort torchscript", "torch eager"),
        "batch-256 throughput ORT / torch (target >= 1.3)": ratio(large, "torch eager", "ort torchscript"),
        "batch-256 throughput torchscript / dynamo graph": ratio(large, "ort dynamo", "ort torchscript"),
        "batch-1 int8 speed-up over fp32 ORT (target >= 1.5)": ratio(small, "ort torchscript", "ort int8"),
        "batch-256 int8 speed-up over fp32 ORT (target >= 1.5)": ratio(large, "ort torchscript", "ort int8"),
        "batch-1 attentions graph / logits graph time": ratio(small, "ort torchscript +attentions", "ort torchscript"),
        "batch-256 attentions graph / logits graph time": ratio(large, "ort torchscript +attentions", "ort torchscript"),
        "batch-256 logits from the attentions graph / logits graph": ratio(large, "ort attentions graph, logits", "ort torchscript"),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    reference, model = load(args.model)
    load_before = machine_load()
    with tempfile.TemporaryDirectory() as scratch:
        paths = export_all(model, Path(scratch), args)
        accuracy = json.loads(paths["report"].read_text())["quantization"]["accuracy"]
        results = measure(model, paths, args)
        kernels = matmul_speedups(model, Path(scratch), args)
    load_after = machine_load()
    print(f"model: {reference}; threads: {args.threads}; torch {torch.__version__}, "
          f"onnxruntime {onnxruntime.__version__} (CPUExecutionProvider); "
          f"load average {load_before['load_average_1min']} -> {load_after['load_average_1min']} "
          f"on {load_before['cpu_count']} cores")
    print("\n".join(table(results)))
    print(f"int8 accuracy on {accuracy['n']} images of {accuracy['data']}: fp32 {accuracy['accuracy_fp32']:.2f}% "
          f"-> int8 {accuracy['accuracy_int8']:.2f}% (top-1 agreement {accuracy['top1_agreement']:.2f}%)")
    measured = {clock: ratios(results, clock) for clock in ("wall_ms", "cpu_ms")}
    print(f"{'ratio':<58} {'wall':>6} {'cpu':>6}")
    for name in measured["wall_ms"]:
        print(f"{name:<58} {measured['wall_ms'][name]:>6.2f} {measured['cpu_ms'][name]:>6.2f}")
    for name, row in kernels.items():
        print(f"{'int8 speed-up, ' + name + ' MatMul alone':<58} {row['wall_ms']:>6.2f} {row['cpu_ms']:>6.2f}")
    print(f"int8 accuracy drop, points (target <= 0.3): {accuracy['accuracy_drop_points']:.2f}")
    command = "python " + " ".join(shlex.quote(part) for part in [sys.argv[0], *(argv or sys.argv[1:])])
    print(f"command: {command}")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "model": reference, "threads": args.threads,
                                         "load_before": load_before, "load_after": load_after,
                                         "results": results, "ratios": measured, "int8_matmul_speedups": kernels,
                                         "int8_accuracy": accuracy}, indent=2))


if __name__ == "__main__":
    main()
