"""`vit-hub` command line: parse, call the library, print. No logic lives here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import CANONICALIZATIONS, PATCH_EMBEDDINGS, PIXEL_NORMS, PRESETS
from .hub_cli import add_hub_commands, run_pull, run_push

# Errors a user can cause; they are printed as one line, never as a traceback.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`vit-hub train: error: ...`) without the
    usage block above it; `--help` still shows the usage. Subcommands inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _size(text: str):
    """'28' -> 28, '32x48' -> [32, 48]."""
    try:
        parts = [int(part) for part in text.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 28 or 32x48, got {text!r}") from None
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return parts
    raise argparse.ArgumentTypeError(f"expected a size like 28 or 32x48, got {text!r}")


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (override the preset or the choice made from the data)")
    group.add_argument("--preset", choices=sorted(PRESETS), help="architecture preset")
    group.add_argument("--image-size", type=_size, help="input size, e.g. 28 or 32x48")
    group.add_argument("--patch-size", type=_size)
    group.add_argument("--in-channels", type=int, choices=(1, 3))
    group.add_argument("--embed-dim", type=int)
    group.add_argument("--depth", type=int)
    group.add_argument("--num-heads", type=int)
    group.add_argument("--mlp-ratio", type=float)
    group.add_argument("--dropout", type=float)
    group.add_argument("--attention-dropout", type=float)
    group.add_argument("--drop-path", type=float, help="stochastic depth rate of the last block")
    group.add_argument("--pos-embedding", choices=("learned", "sincos"))
    group.add_argument("--pooling", choices=("cls", "mean"))
    group.add_argument("--patch-embedding", choices=PATCH_EMBEDDINGS,
                       help="shifted = shifted patch tokenization, convstem = early convolutions (small data)")
    group.add_argument("--locality-attention", action=argparse.BooleanOptionalAction, default=None,
                       help="locality self-attention (small data)")
    group.add_argument("--pixel-norm", choices=PIXEL_NORMS,
                       help="normalise by the training split's mean/std (dataset) or each image's own (image)")
    group.add_argument("--canonicalize", choices=CANONICALIZATIONS,
                       help="bring every input into the training images' frame first (digit: like MNIST)")
    group.add_argument("--mean", type=_floats, help="per-channel mean (default: computed on the training split)")
    group.add_argument("--std", type=_floats, help="per-channel std (default: computed on the training split)")


def _add_training_flags(parser: argparse.ArgumentParser, data_required: bool = True) -> None:
    parser.add_argument("--data", required=data_required,
                        help="image folder, 'mnist' (bundled) or a torchvision name")
    parser.add_argument("--data-root", help="where torchvision datasets' files are (default: ./data)")
    parser.add_argument("--epochs", type=int, help="default: about 200k samples seen, 10 to 200 epochs")
    parser.add_argument("--batch-size", type=int,
                        help="global batch size (all processes); default 128, smaller on small data (about 10 steps an epoch)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default 1e-3, mnist preset 2e-3, x sqrt(batch/128))")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=float, help="default: 5%% of the epochs")
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--augment", default="auto", choices=("auto", "digits", "photos", "none"))
    parser.add_argument("--val-split", type=float, default=0.1,
                        help="share of training images held out when the data has no val split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, help="DataLoader workers (default: half the cores)")
    parser.add_argument("--strict", action="store_true", help="fail on an unreadable image instead of skipping it")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    _add_model_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="vit-hub", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model into a Hub-layout model dir")
    train.add_argument("--out", required=True, help="model dir to write")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    train.add_argument("--overwrite", action="store_true", help="replace a model or run already in --out")
    train.add_argument("--stop-after-epochs", type=int, metavar="N",
                       help="pause after N epochs of this invocation, leaving a resumable checkpoint")
    _add_training_flags(train, data_required=False)  # --resume needs no --data

    evaluate = commands.add_parser(
        "eval", help="evaluate a model; prints one JSON line",
        description="Accuracy and loss of a model on one split of --data, split as training splits it "
                    "(same --val-split and --seed), printed as one JSON line: accuracy, loss, n, split.")
    evaluate.add_argument("--model", required=True, help="model dir or Hub repo id")
    evaluate.add_argument("--data", required=True,
                          help="image folder, 'mnist' (bundled) or a torchvision name; its labels must be the model's")
    evaluate.add_argument("--data-root", help="where torchvision datasets' files are (default: ./data)")
    evaluate.add_argument("--split", choices=("train", "val", "test"),
                          help="default: test when the data has one (mnist, a folder with test/), else val")
    evaluate.add_argument("--val-split", type=float, default=0.1,
                          help="share held out for validation when the data has no val split (as in training)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of that split (as in training)")
    evaluate.add_argument("--batch-size", type=int, default=256)

    predict = commands.add_parser(
        "predict", help="top-k labels for image files",
        description="Top-k labels and probabilities for each image, one line per image. Each image is "
                    "preprocessed as the model's config.json says (mode, size, canonicalisation, mean/std).")
    predict.add_argument("--model", required=True, help="model dir or Hub repo id")
    predict.add_argument("images", nargs="+", help="image files (any size and mode)")
    predict.add_argument("--top-k", type=int, default=3, help="labels shown per image (default 3)")

    info = commands.add_parser("info", help="per-layer parameters and FLOPs")
    source = info.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model dir or Hub repo id")
    source.add_argument("--preset", choices=sorted(PRESETS))

    sweep = commands.add_parser("sweep", help="one short run per hyperparameter value, table + plot")
    sweep.add_argument("--out", required=True, help="folder for the runs, table and plot")
    sweep.add_argument("--overwrite", action="store_true", help="replace runs already in --out")
    sweep.add_argument("--resume", action="store_true",
                       help="continue an interrupted sweep in --out: finished runs are kept, an interrupted "
                            "one continues from its checkpoint, the rest start")
    sweep.add_argument("--param", action="append", required=True, metavar="NAME=V1,V2,...",
                       help="model field or training setting to vary, e.g. num_heads=2,4,8")
    _add_training_flags(sweep)

    inspect = commands.add_parser("inspect", help="what a model learned: patch filters, position similarity, "
                                  "attention distance per head (PNG + inspect.json)")
    inspect.add_argument("--model", required=True, help="model dir or Hub repo id")
    inspect.add_argument("--out", required=True, help="folder for the figures and inspect.json")
    inspect.add_argument("--data", help="images to measure attention distances on: a folder, 'mnist' or a "
                         "torchvision name (default: the bundled samples, for a digit model)")
    inspect.add_argument("--data-root", help="where torchvision datasets' files are (default: ./data)")
    inspect.add_argument("--split", default="val", choices=("train", "val", "test"),
                         help="split of a named dataset (a folder is read whole)")
    inspect.add_argument("--samples", type=int, default=64, help="images to average over (default 64)")
    inspect.add_argument("--seed", type=int, default=0, help="which images are drawn")
    add_hub_commands(commands)
    return parser


def _settings(args: argparse.Namespace):
    from .train import MODEL_FIELDS, TrainSettings, command_line

    model = {field: getattr(args, field, None) for field in MODEL_FIELDS}
    return TrainSettings(
        data=args.data, out=args.out, data_root=args.data_root, preset=args.preset,
        model={k: v for k, v in model.items() if v is not None}, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        warmup_epochs=args.warmup_epochs, label_smoothing=args.label_smoothing, grad_clip=args.grad_clip,
        augment=args.augment, val_split=args.val_split, seed=args.seed, num_workers=args.workers,
        strict=args.strict, compile=args.compile, device=args.device,
        command=command_line(getattr(args, "argv", None)),
    )


def run_train(args: argparse.Namespace) -> None:
    from .train import TrainSettings, train

    if args.resume:  # the checkpoint's own settings are replayed
        train(TrainSettings(data="", out=args.out), resume=True, stop_after_epochs=args.stop_after_epochs)
    elif args.data is None:
        raise ValueError("train: expected --data (an image folder, 'mnist' or a torchvision name), got none")
    else:
        train(_settings(args), stop_after_epochs=args.stop_after_epochs, overwrite=args.overwrite)


def run_eval(args: argparse.Namespace) -> None:
    from . import data as vdata
    from .pretrained import load_model
    from .train import evaluate

    model = load_model(args.model)
    splits = vdata.load_splits(args.data, args.data_root, args.val_split, args.seed)
    if splits.skipped:  # stderr: stdout carries the JSON line scripts parse
        print(splits.skipped_report(), file=sys.stderr)
    if splits.labels != model.config.labels:
        raise ValueError(f"the data's labels {splits.labels[:10]} do not match the model's {model.config.labels[:10]}")
    split = args.split or ("test" if splits.test is not None else "val")
    dataset = vdata.Transformed(splits.split(split), vdata.EvalTransform(model.config))
    loader = vdata.make_loader(dataset, args.batch_size, shuffle=False, seed=0,
                               num_workers=vdata.default_workers(), pin_memory=False)
    result = evaluate(model, loader, next(model.parameters()).device, model.config.num_classes)
    print(json.dumps({"accuracy": result["accuracy"], "loss": result["loss"], "n": result["n"],
                      "split": split, "model": args.model, "data": args.data}))


def run_predict(args: argparse.Namespace) -> None:
    from .pretrained import load_model
    from .predict import predict_images

    model = load_model(args.model)
    for path, ranked in zip(args.images, predict_images(model, args.images, args.top_k)):
        shown = "  ".join(f"{label} {probability:.3f}" for label, probability in ranked)
        print(f"{path}: {shown}")


def run_info(args: argparse.Namespace) -> None:
    from .model import VisionTransformer
    from .summary import summarize

    if args.model:
        from .pretrained import load_model

        model = load_model(args.model)
    else:
        model = VisionTransformer(**PRESETS[args.preset])
    print(summarize(model))


def run_sweep(args: argparse.Namespace) -> None:
    from .sweep import parse_param, sweep

    print(sweep(_settings(args), [parse_param(text) for text in args.param], Path(args.out), args.overwrite,
                args.resume))


def run_inspect(args: argparse.Namespace) -> None:
    from .insight import inspect_model

    written = inspect_model(args.model, args.out, args.data, args.data_root, args.split, args.samples, args.seed)
    print(f"wrote {', '.join(path.name for path in written)} to {Path(args.out)}")


COMMANDS = {"train": run_train, "inspect": run_inspect, "eval": run_eval, "predict": run_predict, "info": run_info, "sweep": run_sweep,
            "push": run_push, "pull": run_pull}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in the model card; None: sys.argv
    try:
        COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
