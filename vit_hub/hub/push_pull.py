"""`vit-hub push` and `vit-hub pull`: parse, call `vit_hub.hub.repos`, print. Light to import."""

from __future__ import annotations

import argparse
from pathlib import Path

from vit_hub.layout import ModelDir


def add_hub_commands(subparsers) -> None:
    """Adds `push` and `pull` to the `vit-hub` subcommands."""
    push = subparsers.add_parser("push", help="upload a model dir to the Hugging Face Hub in one commit")
    push.add_argument("--model", required=True, help="model dir written by `vit-hub train`")
    push.add_argument("--repo-id", required=True, metavar="OWNER/NAME", help="created if it does not exist")
    push.add_argument("--private", action="store_true", help="make the repo private when this push creates it")
    export = ModelDir(Path()).export
    push.add_argument("--with-onnx", action="store_true",
                      help=f"also upload those of the export's files the model dir holds: "
                           f"{', '.join(path.name for path in export.onnx_files)} (never {export.int8.name}); "
                           f"refused, naming the `vit-hub export` command, when it has no {export.logits.name}")
    push.add_argument("--revision", help="branch to commit to (default main; created if missing)")
    push.add_argument("--commit-message",
                      help="the commit's message (default: \"Upload vit_hub model from FOLDER\")")
    push.add_argument("--token", help="Hub token with write access (default: HF_TOKEN, then `hf auth login`); "
                                      "prefer those, a flag is visible to other users of this machine")
    push.add_argument("--overwrite-card", action="store_true",
                      help="replace a README.md that was edited on the Hub instead of keeping it")
    push.add_argument("--dry-run", action="store_true",
                      help="check the model dir and list the files a push would upload; upload nothing, need no token")

    pull = subparsers.add_parser("pull", help="download a vit_hub model repo into a model dir")
    pull.add_argument("repo_id", metavar="OWNER/NAME", help="the Hub model repo to download")
    pull.add_argument("--out", required=True, help="folder to write the model dir to (new or empty)")
    pull.add_argument("--overwrite", action="store_true",
                      help="replace a folder already at --out whole (nothing of it is kept)")
    pull.add_argument("--revision", help="branch, tag or commit (default main)")
    pull.add_argument("--token", help="Hub token for private repos (default: HF_TOKEN, then `hf auth login`)")


def run_push(args: argparse.Namespace) -> None:
    from vit_hub.hub.repos import CARD_KEPT, files_to_push, push_to_hub

    if args.dry_run:
        files = files_to_push(Path(args.model), args.repo_id, args.with_onnx)
        print(f"would push {', '.join([*files, ModelDir.card])} to {args.repo_id}@{args.revision or 'main'}")
        print("not uploaded (--dry-run)")
        return
    result = push_to_hub(args.model, args.repo_id, private=args.private or None, with_onnx=args.with_onnx,
                         revision=args.revision, commit_message=args.commit_message, token=args.token,
                         overwrite_card=args.overwrite_card)
    print(f"pushed {', '.join(result.files)} to {result.repo_id}@{result.revision}: {result.commit_url}")
    print(f"model card: {result.card}")
    if result.card == CARD_KEPT:
        print("  (the README.md on the Hub was edited there; --overwrite-card replaces it with a generated one)")


def run_pull(args: argparse.Namespace) -> None:
    from vit_hub.hub.repos import pull

    out = pull(args.repo_id, args.out, revision=args.revision, token=args.token, overwrite=args.overwrite)
    print(f"pulled {args.repo_id}@{args.revision or 'main'} into {out}")

