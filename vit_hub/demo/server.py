"""app.py's command line: flags, the address to listen on, signals, then serve the page.

Bound to 127.0.0.1 unless told otherwise (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT, as a
Hugging Face Space sets them, or --host/--port), with analytics, share links and server-side
rendering off. In a Space folder written by `vit-hub space`, its space.json names the model,
so `python app.py` starts the Space's app with no flags.

The flags are parsed and the address checked before gradio, torch or onnxruntime load (they
load in `main`, once there is something to serve), so `--help` and a refused flag answer at
once.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from vit_hub.console import OneLineErrorParser
from vit_hub.demo.backends import BACKENDS, load_predictor
from vit_hub.errors import UserError
from vit_hub.hub.space import SpaceSettings, read_settings

CHECKOUT = Path(__file__).resolve().parents[2]  # where app.py is: a clone, or a Space folder
# The bundled digit model: a clone's models/vit-mnist, else the copy `pip install .` put in the
# package (pyproject.toml maps that folder to vit_hub/bundled/model).
CHECKOUT_MODEL = CHECKOUT / "models" / "vit-mnist"
INSTALLED_MODEL = Path(__file__).resolve().parents[1] / "bundled" / "model"
DEFAULT_MODEL = CHECKOUT_MODEL if CHECKOUT_MODEL.is_dir() else INSTALLED_MODEL
APP = "app.py"  # how the app is started in a clone or a Space; `python -m vit_hub.demo` for a package
MAX_PORT = 65535


def parse_args(argv: list[str] | None = None, prog: str = APP) -> argparse.Namespace:
    """The flags; in a Space folder (`vit-hub space` wrote space.json beside app.py) the model,
    revision and backend default to the Space's, and a Space's GRADIO_SERVER_NAME and
    GRADIO_SERVER_PORT give the address, so `python app.py` needs no flags there."""
    try:
        space = read_settings(CHECKOUT)
    except (OSError, UserError) as error:
        raise SystemExit(f"{prog}: {error}") from None
    return build_parser(space, prog).parse_args(argv)


def build_parser(space: SpaceSettings | None, prog: str = APP) -> argparse.ArgumentParser:
    """app.py's flags, their defaults from `space` (a Space folder's space.json) when given."""
    parser = OneLineErrorParser(prog=prog, description=(
        "Serve a vit_hub model in a Gradio page: upload or draw an image, see the top classes and a map of "
        "the patches that made the model say so. Also an HTTP API (/predict, /predict_labels, /explain)."))
    parser.add_argument("--model", default=space.model if space else str(DEFAULT_MODEL),
                        help="model dir or Hugging Face Hub repo id (default: " +
                             ("the Space's, %(default)s)" if space else "the bundled MNIST digit model)"))
    parser.add_argument("--revision", default=space.revision if space else None,
                        help="branch, tag or commit of a Hub repo id (default: the Space's pinned commit in a "
                             "Space folder, else main)")
    parser.add_argument("--backend", choices=BACKENDS, default=space.backend if space else "torch",
                        help="torch computes every explanation method; onnx runs ONNX Runtime without torch on "
                             "the model's model_attentions.onnx (exported to a temporary folder first when it has "
                             "none) and offers the methods that need no gradients (default: %(default)s)")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1",
                        help="address to listen on; 0.0.0.0 opens the app to the network (default: "
                             "GRADIO_SERVER_NAME, else 127.0.0.1, this machine only; now %(default)s)")
    parser.add_argument("--port", type=_port, default=os.environ.get("GRADIO_SERVER_PORT") or "7860",
                        help="port to listen on (default: GRADIO_SERVER_PORT, else 7860; now %(default)s)")
    return parser


def _port(text: str) -> int:
    if not (text.isdigit() and 1 <= int(text) <= MAX_PORT):
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to {MAX_PORT}, got {text!r}")
    return int(text)


def check_can_listen(host: str, port: int, prog: str = APP) -> None:
    """Bind once, before the model loads: Gradio reports every bind failure (port taken, no
    such address) as "Cannot find empty port", with a traceback."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        raise SystemExit(f"{prog}: --host {host} --port {port}: expected an address and port this machine can "
                         f"listen on, got {error.strerror or error}") from None


_sigterm_received = False


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (a service manager, `kill`) exits like Ctrl-C does, so exit handlers run and
    a temporary export folder is removed. A second SIGTERM during that shutdown (`kill` of
    the whole process group reaches the app twice through make) returns here and is
    dropped: the handler stays installed, because swapping in SIG_IGN while a signal is
    pending makes Python print a "race condition" traceback."""
    global _sigterm_received
    if _sigterm_received:
        return
    _sigterm_received = True
    sys.exit(128 + signum)


def main(argv: list[str] | None = None, prog: str = APP) -> None:
    args = parse_args(argv, prog)
    check_can_listen(args.host, args.port, prog)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from vit_hub.demo.page import build_demo, serve  # gradio loads here

    try:
        predictor = load_predictor(args.model, args.backend, args.revision)
        predictor.config.check_has_head("the app")
    except (OSError, UserError) as error:
        raise SystemExit(f"{prog}: cannot load --model {args.model}: {error}") from None
    # Gradio's own start-up lines include a hint to set share=True; this app never shares.
    print(f"{prog}: serving {args.model} ({predictor.description}) at http://{args.host}:{args.port} "
          f"(no share link, no analytics; Ctrl-C stops)", flush=True)
    try:
        serve(build_demo(predictor), args.host, args.port, quiet=True)
    except OSError as error:  # taken since check_can_listen
        raise SystemExit(f"{prog}: --host {args.host} --port {args.port}: expected an address and port this "
                         f"machine can listen on, got {error}") from None
