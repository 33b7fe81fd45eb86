"""`vit-hub` command line: parse, call the library, print. No logic lives here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from vit_hub.console import OneLineErrorParser, add_field_flags, escaped, run_reporting_errors
from vit_hub.errors import UserError
from vit_hub.hub.push_pull import add_hub_commands, run_pull, run_push
from vit_hub.layout import ModelDir
from vit_hub.model.config import PRESETS, ViTConfig, size_text

DESCRIPTION = ("Train a Vision Transformer on a folder of images, evaluate it, push it to the Hugging Face Hub "
               "and see what it learned. Each command's --help lists its flags and their defaults.")
EXAMPLES = """examples:
  vit-hub train --data path/to/folder --out runs/my-model      # a model dir: weights, config, card, plots
  vit-hub predict --model runs/my-model photo.jpg --top-k 3    # the top 3 labels of an image
  vit-hub export --model runs/my-model --out runs/my-model     # ONNX graphs beside the weights, verified
  vit-hub push --model runs/my-model --repo-id you/my-model    # one commit to the Hub (needs HF_TOKEN)
"""


def data_help(what: str) -> str:
    """What a --data flag accepts, from the lists the data loader reads."""
    from vit_hub.data.choices import TORCHVISION_DATASETS

    return (f"{what}: an image folder (FOLDER/CLASS/IMAGE, or FOLDER/train/ beside test/ and/or val/), "
            f"a Hugging Face dataset (hf://datasets/OWNER/NAME[@REVISION], a folder of its parquet shards or "
            f"one save_to_disk wrote), 'mnist' (the bundled copy, offline) or a torchvision dataset "
            f"({', '.join(TORCHVISION_DATASETS)}) whose files are already under --data-root")


def preset_help() -> str:
    """Each architecture preset with its size, from PRESETS."""
    shown = [f"{name} ({values['image_size']} px, patch {values['patch_size']}, width {values['embed_dim']}, "
             f"depth {values['depth']})" for name, values in PRESETS.items()]
    return "presets: " + "; ".join(shown)


def _add_training_flags(parser: argparse.ArgumentParser, data_required: bool = True) -> None:
    from vit_hub.train.settings import MODEL_FIELDS, TrainSettings

    needed = "" if data_required else " (default: none; needed unless --resume, which reads the run's own)"
    parser.add_argument("--data", required=data_required, help=data_help("images to train on") + needed)
    training = tuple(field.name for field in dataclasses.fields(TrainSettings)
                     if field.name not in ("data", "out", "model", "command"))
    add_field_flags(parser, TrainSettings, training, notes={"preset": preset_help()})
    group = parser.add_argument_group("model (override the preset or the choice made from the data)")
    add_field_flags(group, ViTConfig, MODEL_FIELDS, set_first_by="from the preset or the data")


MODEL_HELP = "model dir or Hub repo id"
DATA_ROOT_HELP = "where torchvision datasets' files are (default: VIT_HUB_DATA_ROOT, else ./data)"


def build_parser() -> argparse.ArgumentParser:
    """`vit-hub` and one subcommand per job; each `_add_*` builds one subcommand's flags."""
    parser = OneLineErrorParser(prog="vit-hub", description=DESCRIPTION, epilog=EXAMPLES)
    commands = parser.add_subparsers(dest="command", required=True)
    for add_command in (_add_train, _add_eval, _add_predict, _add_info, _add_sweep, _add_inspect, _add_import,
                        _add_export):
        add_command(commands)
    add_hub_commands(commands)
    _add_space(commands)
    return parser


def _add_train(commands) -> None:
    train = commands.add_parser("train", help="train a model into a Hub-layout model dir")
    train.add_argument("--out", required=True, help="model dir to write (new, empty, or with --resume or "
                       "--overwrite)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint; "
                       "flags given again must match the run's")
    train.add_argument("--overwrite", action="store_true", help="replace a model or run already in --out")
    train.add_argument("--stop-after-epochs", type=int, metavar="N",
                       help="pause after N epochs of this invocation, leaving a resumable checkpoint "
                            "(default: run to the last epoch)")
    _add_training_flags(train, data_required=False)  # --resume needs no --data


def _add_eval(commands) -> None:
    evaluate = commands.add_parser(
        "eval", help="evaluate a model; prints one JSON line",
        description="Accuracy and loss of a model on one split of --data, split as training splits it "
                    "(same --val-split and --seed), printed as one JSON line: accuracy, loss, n, split.")
    evaluate.add_argument("--model", required=True, help=MODEL_HELP)
    evaluate.add_argument("--data", required=True,
                          help=data_help("images to evaluate on, with the model's labels"))
    evaluate.add_argument("--data-root", help=DATA_ROOT_HELP)
    from vit_hub.train.settings import TrainSettings

    add_field_flags(evaluate, TrainSettings, ("data_config", "image_column", "label_column"))
    evaluate.add_argument("--split", choices=("train", "val", "test"),
                          help="split to evaluate (default: test when the data has one, as mnist and a folder "
                               "with test/ do, else val)")
    evaluate.add_argument("--val-split", type=float, default=0.1,
                          help="share held out for validation when the data has no val split (as in training; "
                               "default: %(default)s)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of that split (as in training)")
    evaluate.add_argument("--batch-size", type=int, default=256, help="images per forward pass")


def _add_predict(commands) -> None:
    predict = commands.add_parser(
        "predict", help="top-k labels for image files",
        description="Top-k labels and probabilities for each image, one line per image. Each image is "
                    f"preprocessed as the model's {ModelDir.config} says (mode, size, canonicalisation, mean/std).")
    predict.add_argument("--model", required=True, help=MODEL_HELP)
    predict.add_argument("images", nargs="+", help="image files (any size and mode)")
    predict.add_argument("--top-k", type=int, default=3, help="labels shown per image")


def _add_info(commands) -> None:
    info = commands.add_parser("info", help="per-layer parameters and FLOPs")
    source = info.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=f"{MODEL_HELP} (this or --preset)")
    source.add_argument("--preset", choices=tuple(PRESETS), help=f"an architecture preset (this or --model); "
                        f"{preset_help()}")


def _add_sweep(commands) -> None:
    sweep = commands.add_parser("sweep", help="one short run per hyperparameter value, table + plot")
    sweep.add_argument("--out", required=True, help="folder for the runs, table and plot")
    sweep.add_argument("--overwrite", action="store_true", help="replace runs already in --out")
    sweep.add_argument("--resume", action="store_true",
                       help="continue an interrupted sweep in --out: finished runs are kept, an interrupted "
                            "one continues from its checkpoint, the rest start")
    sweep.add_argument("--param", action="append", required=True, metavar="NAME=V1,V2,...",
                       help=_param_help())
    _add_training_flags(sweep)


def _add_inspect(commands) -> None:
    inspect = commands.add_parser("inspect", help="what a model learned: patch filters, position similarity, "
                                  f"attention distance per head (PNG + {ModelDir.inspect_report})")
    inspect.add_argument("--model", required=True, help=MODEL_HELP)
    inspect.add_argument("--out", required=True, help=f"folder for the figures and {ModelDir.inspect_report}")
    inspect.add_argument("--data", help=data_help("images to measure attention distances on") +
                         " (default: the bundled samples for a digit model, else the model dir's own samples/)")
    inspect.add_argument("--data-root", help=DATA_ROOT_HELP)
    inspect.add_argument("--split", default="val", choices=("train", "val", "test"),
                         help="split of a named dataset (a folder is read whole)")
    inspect.add_argument("--samples", type=int, default=64, help="images to average over")
    inspect.add_argument("--seed", type=int, default=0, help="which images are drawn")


def _add_import(commands) -> None:
    importer = commands.add_parser(
        "import", help="convert a timm or transformers ViT into a vit_hub model dir",
        description="Convert a pretrained ViT, exactly, into an ordinary vit_hub model dir (config, weights, card "
                    f"naming the source and its licence): a timm vit_* model ({ModelDir.config} with architecture "
                    "and pretrained_cfg) or a transformers ViT (model_type vit: ViTForImageClassification, or "
                    f"ViTModel without a head). Only {ModelDir.weights} is read.")
    importer.add_argument("source", metavar="SRC", help="Hub repo id (e.g. timm/vit_base_patch16_224.augreg2_in21k_ft_in1k, "
                          "google/vit-base-patch16-224) or a local folder")
    importer.add_argument("--out", required=True, help="model dir to write (new or empty)")
    importer.add_argument("--revision", help="branch, tag or commit of a Hub repo (default main)")
    importer.add_argument("--token", help="Hub token for gated or private repos (default: HF_TOKEN, then `hf auth login`)")


def _add_export(commands) -> None:
    from vit_hub.export.options import DESCRIPTION, FILES_WRITTEN, add_export_flags  # light: the export loads when run

    export = commands.add_parser("export", help="ONNX graphs of a model, verified against torch, with a report",
                                 description=f"{DESCRIPTION} The same as `python -m vit_hub.export`.\n\n{FILES_WRITTEN}")
    add_export_flags(export)


def _add_space(commands) -> None:
    space = commands.add_parser(
        "space", help="write and upload a Hugging Face Space that demos a model: a Gradio app, or with --static "
                      "a page that runs the model in the visitor's browser",
        description="Write a Hugging Face Space that serves MODEL with this project's app (ONNX backend, CPU, "
                    "no torch) and upload it to --repo-id. A model folder is bundled into the Space (small models); "
                    "a Hub repo id is downloaded when the Space starts, pinned to the commit it has now.")
    space.add_argument("model", metavar="MODEL", help="model dir with its ONNX graphs (vit-hub export "
                       "--output-attentions), or the Hub repo id of one pushed with --with-onnx")
    space.add_argument("--repo-id", required=True, metavar="OWNER/NAME", help="the Space; created if it does not exist")
    space.add_argument("--out", help="folder to write the Space to (default: ./NAME); a Space folder written "
                                     "before and unchanged since is replaced, any other folder refused")
    space.add_argument("--revision", help="branch, tag or commit of a Hub MODEL to pin (default: main)")
    space.add_argument("--private", action="store_true", help="make the Space private when this creates it")
    space.add_argument("--dry-run", action="store_true", help="write the folder only, upload nothing")
    space.add_argument("--token", help="Hub token with write access (default: HF_TOKEN, then `hf auth login`)")
    space.add_argument("--static", action="store_true",
                       help="a static Space instead: the model runs in the visitor's browser with ONNX Runtime Web, "
                            "no server; it bundles pipeline_explain.onnx (the map the app's page opens with, and "
                            "rollout, drawn over the image) where the export wrote one, else pipeline_map.onnx "
                            "(rollout), else pipeline.onnx (labels alone) (default: off)")
    space.add_argument("--onnxruntime-web", metavar="TGZ", help="with --static: the tarball of `npm pack "
                       "onnxruntime-web@VERSION` to vendor (default: downloaded from npm's registry once, checked)")
    space.add_argument("--demo-url", metavar="URL", help="with --static: the Gradio demo the page links to for maps "
                       "(default: none)")


def _param_help() -> str:
    """What --param accepts, from the names `vit-hub sweep` varies."""
    from vit_hub.train.settings import MODEL_FIELDS, TRAINING_FIELDS

    return (f"a setting to vary, one run per value (repeat for more settings), e.g. num_heads=2,4,8; NAME is a "
            f"model field ({', '.join(MODEL_FIELDS)}) or a training setting ({', '.join(TRAINING_FIELDS)})")


def _given_settings(args: argparse.Namespace) -> dict:
    """The TrainSettings fields whose flags were given (every flag defaults to None), the
    ViTConfig ones under `model`."""
    from vit_hub.train.settings import MODEL_FIELDS, TrainSettings

    def given(names) -> dict:
        return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}

    training = [field.name for field in dataclasses.fields(TrainSettings) if field.name not in ("model", "command")]
    return {**given(training), "model": given(MODEL_FIELDS)}


def _settings(args: argparse.Namespace):
    """TrainSettings from the flags that were given; the dataclass supplies the rest."""
    from vit_hub.train.settings import TrainSettings, command_line

    return TrainSettings(**_given_settings(args), command=command_line(getattr(args, "argv", None)))


def run_train(args: argparse.Namespace) -> None:
    from vit_hub.train.settings import TrainSettings, check_settings

    if args.resume:  # the checkpoint's own settings are replayed; flags given again must match them
        settings = TrainSettings(data="", out=args.out)
        flags = {name: value for name, value in _given_settings(args).items() if name != "out"}
    elif args.data is None:
        raise UserError("train: expected --data (an image folder, a Hugging Face dataset, 'mnist' or a "
                        "torchvision name), got none")
    else:
        settings, flags = _settings(args), None
        check_settings(settings)  # a flag that cannot train is refused before torch loads
    from vit_hub.train.run import train

    train(settings, resume=args.resume, stop_after_epochs=args.stop_after_epochs, overwrite=args.overwrite,
          resume_flags=flags)


def run_eval(args: argparse.Namespace) -> None:
    from vit_hub.data.batches import EvalTransform, Transformed, default_workers, make_loader
    from vit_hub.data.sources import load_splits
    from vit_hub.hub.pretrained import load_model
    from vit_hub.train.evaluation import evaluate

    model = load_model(args.model)
    from vit_hub.data.hub_datasets import DatasetOptions

    options = DatasetOptions(args.data_config, args.image_column, args.label_column)
    splits = load_splits(args.data, args.data_root, args.val_split, args.seed, options=options)
    if splits.labels != model.config.labels:
        raise UserError(f"the data's labels {splits.labels[:10]} do not match the model's {model.config.labels[:10]}")
    split = args.split or ("test" if splits.test is not None else "val")
    dataset = Transformed(splits.split(split), EvalTransform(model.config))
    loader = make_loader(dataset, args.batch_size, shuffle=False, seed=0, num_workers=default_workers(),
                         pin_memory=False)
    result = evaluate(model, loader, next(model.parameters()).device, model.config.num_classes)
    if splits.skipped:  # files are checked as they are read; stderr: stdout carries the JSON line scripts parse
        print(splits.skipped_report(), file=sys.stderr)
    print(json.dumps({"accuracy": result["accuracy"], "loss": result["loss"], "n": result["n"],
                      "split": split, "model": args.model, "data": args.data}))


def run_predict(args: argparse.Namespace) -> None:
    from vit_hub.hub.pretrained import load_model, predict_images

    model = load_model(args.model)
    for path, ranked in zip(args.images, predict_images(model, args.images, args.top_k)):
        shown = "  ".join(f"{escaped(label)} {probability:.3f}" for label, probability in ranked)
        print(f"{escaped(str(path))}: {shown}")


def run_info(args: argparse.Namespace) -> None:
    from vit_hub.model.flops import summarize
    from vit_hub.model.vit import VisionTransformer

    if args.model:
        from vit_hub.hub.pretrained import load_model

        model = load_model(args.model)
    else:
        model = VisionTransformer(**PRESETS[args.preset])
    print(summarize(model))


def run_sweep(args: argparse.Namespace) -> None:
    from vit_hub.train.sweep import parse_param, sweep

    print(sweep(_settings(args), [parse_param(text) for text in args.param], Path(args.out), args.overwrite,
                args.resume))


def run_import(args: argparse.Namespace) -> None:
    from vit_hub.hub.fine_tune import describe
    from vit_hub.hub.import_model import import_model, write_model_dir
    from vit_hub.train.settings import command_line

    imported = import_model(args.source, args.revision, args.token)
    out = write_model_dir(imported, args.out, command_line(getattr(args, "argv", None)))
    config = imported.config
    head = f"{config.num_classes} classes" if config.num_classes else "no head (features only: fine-tune with --init)"
    print(f"imported {describe(imported.source)} into {out}: {size_text(config.image_size)}, "
          f"patch {size_text(config.patch_size)}, dim {config.embed_dim}, depth {config.depth}, "
          f"heads {config.num_heads}, {head}")
    for note in imported.source["notes"]:
        print(f"note: {note}")


def run_inspect(args: argparse.Namespace) -> None:
    from vit_hub.hub.pretrained import load_model
    from vit_hub.insight.inspect import inspect_model

    model = load_model(args.model)
    model_dir = Path(args.model) if Path(args.model).is_dir() else None  # a Hub repo's snapshot keeps no samples
    written = inspect_model(model, args.out, args.data, args.data_root, args.split, args.samples, args.seed,
                            model_dir)
    print(f"wrote {', '.join(path.name for path in written)} to {Path(args.out)}")


def run_space(args: argparse.Namespace) -> None:
    from vit_hub.hub.space import push_space, space_url, write_space

    out = Path(args.out or args.repo_id.rpartition("/")[2])
    if args.static:
        from vit_hub.export.pipeline_check import check_pipeline  # what the page needs to run, checked now
        from vit_hub.hub.static_space import write_static_space

        written = write_static_space(args.model, out, args.repo_id, args.onnxruntime_web, args.demo_url,
                                     check_pipeline=check_pipeline)
        size = sum((written.folder / name).stat().st_size for name in written.files)
        graph = next(Path(name).name for name in written.files if name.endswith(".onnx"))  # the one graph bundled
        print(f"wrote the static Space to {written.folder}: {len(written.files)} files, {size / 1e6:.1f} MB, running "
              f"{args.model}'s {graph} in the browser")
    else:
        from vit_hub.export.graph_check import check_graph  # what the Space's app checks at start, checked now

        written = write_space(args.model, out, args.repo_id, args.revision, args.token, check_graph=check_graph)
        served = (f"{written.settings.model}@{written.settings.revision}" if written.settings.revision
                  else f"{args.model}, bundled")
        print(f"wrote the Space to {written.folder}: {len(written.files)} files, serving {served}")
    if written.backup is not None:
        print(f"kept the folder it replaced as {written.backup}: it holds files the new Space lacks or has "
              f"otherwise; delete it once nothing in it is needed")
    out = written.folder  # absolute: with `--out .` the working folder is now the backup
    if args.dry_run:
        print(f"not uploaded (--dry-run); without it the Space goes to {space_url(args.repo_id)}")
        return
    sdk = "static" if args.static else "gradio"
    print(f"uploaded: {push_space(out, args.repo_id, private=args.private or None, token=args.token, sdk=sdk)}")


def run_export(args: argparse.Namespace) -> int:
    """`python -m vit_hub.export`'s own: a graph that fails verification exits 1."""
    from vit_hub.export.__main__ import run_export as export_and_exit  # light: torch loads once the flags pass

    return export_and_exit(args)


COMMANDS = {"train": run_train, "inspect": run_inspect, "eval": run_eval, "predict": run_predict, "info": run_info, "sweep": run_sweep,
            "push": run_push, "pull": run_pull, "import": run_import, "export": run_export, "space": run_space}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in the model card; None: sys.argv
    if args.command == "export":  # its own exit codes, as `python -m vit_hub.export` gives them
        return run_export(args)
    return run_reporting_errors(lambda: COMMANDS[args.command](args))
