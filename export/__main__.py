"""`python -m vit_hub.export --model DIR|REPO_ID --out PATH [--opset N] [--output-attentions]
[--precision fp16] [--quantize int8] [--calib-data D]`: export, verify, report. Thin: parse, call, print.
`vit-hub export` takes the same flags (`options.py`) and runs `run_export`. The flags are parsed
and checked before torch and onnxruntime load, so `--help` and a refused flag answer at once."""

from __future__ import annotations

import argparse
import json
import sys

from vit_hub.console import OneLineErrorParser, run_reporting_errors
from vit_hub.layout import ExportLayout

from .options import DESCRIPTION, FILES_WRITTEN, add_export_flags, check_export_flags


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m vit_hub.export", description=f"{DESCRIPTION}\n\n{FILES_WRITTEN}")
    add_export_flags(parser)
    return parser


def summary(report: dict) -> list[str]:
    """One line per graph (and one for int8 accuracy and speed)."""
    lines = []
    for name, graph in report["graphs"].items():
        worst = {key: max(row[key] for row in graph["parity"]) for key in graph.get("parity", [{}])[0]
                 if key.endswith("_max_abs_diff")}
        shown = ", ".join(f"{key.removesuffix('_max_abs_diff')} max|diff| {value:.1e}" for key, value in worst.items())
        shown += f" on {graph['parity'][0]['provider']}" if shown else ""
        lines.append(f"{name}: {graph['bytes'] / 1e6:.2f} MB, opset {graph['opset']}, checker passed"
                     + (f", {shown}" if shown else ""))
    for name, check in report.get("pipeline", {}).items():
        if "skipped" in check:
            lines.append(f"{name}: not written: {check['skipped']}")
            continue
        agreeing = sum(row["same_label"] for row in check["rows"])
        mapped = f"{check['method']} map" if "method" in check else "rollout map"  # pipeline_explain.onnx's: the page's
        lines.append(f"{name}: the Python path's label on {agreeing}/{check['uploads']} uploads, probabilities "
                     f"max|diff| {check['max_abs_diff']:.1e} (tolerance {check['tolerance_max_abs_diff']:g})"
                     + (f", {mapped} max|diff| {check['map_max_abs_diff']:.1e} (tolerance "
                        f"{check['map_tolerance_max_abs_diff']:g})" if "map_max_abs_diff" in check else ""))
    preprocessing = report.get("preprocess")
    if preprocessing:
        lines.append(f"{preprocessing['graph']}: the Python path's pixel values on {preprocessing['uploads']} uploads, "
                     f"max|diff| {preprocessing['max_abs_diff']:.1e} (tolerance {preprocessing['tolerance_max_abs_diff']:g})")
    half = report.get("fp16")
    if half:
        lines.append(f"fp16: top-1 agreement with fp32 {half['top1_agreement']:.2f}% on {half['n']} images "
                     f"({half['data']}), logits max|diff| {half['logits_max_abs_diff_vs_fp32']:.1e} on {half['provider']}")
    quantization = report.get("quantization")
    if quantization:
        accuracy, speed = quantization["accuracy"], quantization["speed"]["per_call"]
        speedups = ", ".join(f"batch {row['batch']} {row['speedup']:.2f}x" for row in speed)
        lines.append(f"int8: accuracy {accuracy['accuracy_fp32']:.2f}% -> {accuracy['accuracy_int8']:.2f}% "
                     f"on {accuracy['n']} images ({accuracy['data']}); speed vs fp32: {speedups}")
    return lines


def main(argv: list[str] | None = None) -> int:
    return run_export(build_parser().parse_args(argv))


def run_export(args: argparse.Namespace) -> int:
    """Check the flags, then export: the exit code (0; 1 for a graph that failed verification,
    2 for a user error, each printed as one line)."""
    refused = run_reporting_errors(lambda: check_export_flags(args))
    if refused:
        return refused
    from .verify import VerificationError  # torch loads here

    return run_reporting_errors(lambda: export_and_report(args), failed_checks=(VerificationError,))


def export_and_report(args: argparse.Namespace) -> None:
    from .export_model import export_onnx

    path = export_onnx(args.model, args.out, opset=args.opset, output_attentions=args.output_attentions,
                       exporter=args.exporter, quantize=args.quantize, calib_data=args.calib_data,
                       data_root=args.data_root, eval_limit=args.eval_limit, precision=args.precision)
    layout = ExportLayout.for_model(path)
    for line in summary(json.loads(layout.report.read_text())):
        print(line)
    written = [path.name for path in (*layout.onnx_files, layout.int8) if path.suffix == ".onnx" and path.is_file()]
    print(f"wrote {layout.folder}/: {', '.join(written)}, {layout.config.name}, {layout.report.name}")


if __name__ == "__main__":
    sys.exit(main())
