"""Every command line's --help: each flag says what it does and its default, the top level shows
examples, and the flags that take a kind of thing (--data, --preset, --param) list the kinds.

The parsers are walked (every subcommand of `vit-hub`, `python -m vit_hub.export`, `app.py`), so a flag
added without help, or with help that never says its default, fails here by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from vit_hub import cli
from vit_hub.console import default_text
from vit_hub.data.choices import TORCHVISION_DATASETS
from vit_hub.demo import server
from vit_hub.export.__main__ import build_parser as export_parser
from vit_hub.layout import ModelDir
from vit_hub.model.config import PRESETS, ViTConfig
from vit_hub.train.settings import MODEL_FIELDS, TRAINING_FIELDS, TrainSettings

REPO = Path(__file__).resolve().parents[1]


def parsers() -> dict[str, argparse.ArgumentParser]:
    """{prog: parser} for every command line and every `vit-hub` subcommand."""
    found = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        found[parser.prog] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    walk(child)

    for parser in (cli.build_parser(), export_parser(), server.build_parser(None)):
        walk(parser)
    return found


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help line --help prints for `action`, defaults filled in."""
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def in_required_group(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    return any(group.required and action in group._group_actions for group in parser._mutually_exclusive_groups)


def flags_and_helps() -> list[tuple[str, str, str, argparse.Action, argparse.ArgumentParser]]:
    """(prog, flag, shown help, action, its parser) for every argument but -h and the commands."""
    rows = []
    for prog, parser in parsers().items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            rows.append((prog, name, shown_help(parser, action), action, parser))
    return rows


def test_the_walk_reaches_every_command_line():
    progs = set(parsers())
    assert {"python -m vit_hub.export", "vit-hub"} <= progs
    assert {f"vit-hub {name}" for name in cli.COMMANDS} <= progs
    assert len(progs) == len(cli.COMMANDS) + 3  # vit-hub, its commands, export, app.py


def test_every_argument_says_what_it_does():
    missing = [f"{prog} {name}" for prog, name, text, _, _ in flags_and_helps() if len(text.strip()) < 12]
    assert missing == [], f"arguments without help: {missing}"


def test_every_optional_flag_says_its_default():
    """A flag a caller may leave out says what happens then: the value argparse holds (filled in
    by the shared formatter), "off" for a switch, or in words when it is worked out later."""
    missing = [f"{prog} {name}: {text!r}" for prog, name, text, action, parser in flags_and_helps()
               if action.option_strings and not action.required and not in_required_group(parser, action)
               and "default" not in text.lower()]
    assert missing == [], "flags whose help gives no default:\n" + "\n".join(missing)


def test_a_stated_default_is_the_real_one():
    """Where the default is a value (argparse's, or the dataclass field's for the flags
    `vit-hub train` and `sweep` generate from TrainSettings and ViTConfig), --help shows it."""
    fields = {field.name: field.default for cls in (TrainSettings, ViTConfig) for field in dataclasses.fields(cls)}
    wrong = []
    for prog, name, text, action, _ in flags_and_helps():
        if not action.option_strings:
            continue
        if action.default == str(server.DEFAULT_MODEL):  # a path on this machine, said in words
            expected = "the bundled MNIST digit model"
        elif action.default is not None:
            expected = default_text(action.default)
        elif prog in ("vit-hub train", "vit-hub sweep") and fields.get(action.dest) not in (None, dataclasses.MISSING):
            expected = default_text(fields[action.dest])
        else:
            continue
        if expected not in text or "default: False" in text or "default: True" in text:  # one style: on / off
            wrong.append(f"{prog} {name}: {expected!r} not in {text!r}")
    assert wrong == [], "\n".join(wrong)


def test_help_loads_no_torch():
    """`vit-hub --help` and each command's --help answer at once: building the parser imports no
    torch (nor anything that does)."""
    code = ("import sys\nfrom vit_hub.cli import build_parser\nparser = build_parser()\nparser.format_help()\n"
            "assert 'torch' not in sys.modules, [name for name in sys.modules if name.startswith('vit_hub')]\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


HEAVY = ("torch", "gradio", "onnxruntime")
# How each entry point is started: `vit-hub` (its console script calls cli.main), `python -m
# vit_hub.export`, `python app.py`.
ENTRY_POINTS = {"vit-hub": "from vit_hub.cli import main\nsys.exit(main(sys.argv[1:]))",
                "python -m vit_hub.export": "runpy.run_module('vit_hub.export', run_name='__main__', alter_sys=True)",
                "python app.py": "runpy.run_path('app.py', run_name='__main__')"}
# (entry point, argv, exit code, a word its answer holds); TAKEN: a port another program listens on.
ANSWERS_AT_ONCE = [
    ("vit-hub", ["train", "--help"], 0, "--lr"),
    ("vit-hub", ["train", "--data", "mnist", "--out", "OUT", "--lr", "inf"], 2, "--lr"),
    ("vit-hub", ["export", "--model", "MODEL", "--out", "OUT", "--opset", "5"], 2, "--opset"),
    ("python -m vit_hub.export", ["--help"], 0, "--output-attentions"),
    ("python -m vit_hub.export", ["--model", "MODEL", "--out", "OUT", "--eval-limit", "0"], 2, "--eval-limit"),
    ("python app.py", ["--help"], 0, "--backend"),
    ("python app.py", ["--port", "0"], 2, "--port"),
    ("python app.py", ["--port", "TAKEN"], 1, "--port"),  # the address is checked before the model loads
]


@pytest.mark.parametrize("entry, argv, code, word", ANSWERS_AT_ONCE,
                         ids=[f"{entry} {' '.join(argv)}" for entry, argv, _, _ in ANSWERS_AT_ONCE])
def test_help_and_refused_flags_load_no_torch_gradio_or_onnxruntime(entry, argv, code, word, tmp_path):
    """`--help` and a refused flag answer before torch, gradio or onnxruntime load (seconds each
    on a busy machine): each entry point parses and checks its flags without importing them."""
    places = {"MODEL": str(REPO / "models" / "vit-mnist"), "OUT": str(tmp_path / "out")}
    argv = [places.get(arg, arg) for arg in argv]
    script = (
        "import runpy, socket, sys\n"
        "taken = socket.create_server(('127.0.0.1', 0))\n"
        f"sys.argv = ['prog'] + [str(taken.getsockname()[1]) if arg == 'TAKEN' else arg for arg in {argv!r}]\n"
        "try:\n" + "".join(f"    {line}\n" for line in ENTRY_POINTS[entry].splitlines()) +
        "except SystemExit as exit_:\n"
        "    if not isinstance(exit_.code, (int, type(None))):  # a message: printed, exit code 1\n"
        "        print(exit_.code, file=sys.stderr)\n"
        "    code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)\n"
        f"print(code, [name for name in {HEAVY!r} if name in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"{code} []", (done.stdout[-300:], done.stderr[-300:])
    assert word in done.stdout + done.stderr and "Traceback" not in done.stderr, (done.stdout[-300:], done.stderr)
    assert not (tmp_path / "out").exists()


def test_the_top_level_help_shows_an_example_of_each_step():
    text = cli.build_parser().format_help()
    examples = [line for line in text.partition("examples:")[2].splitlines() if line.strip().startswith("vit-hub ")]
    assert [line.split()[1] for line in examples] == ["train", "predict", "export", "push"], text


def test_the_top_level_help_names_both_kinds_of_space():
    text = " ".join(cli.build_parser().format_help().split())
    assert "space write and upload a Hugging Face Space" in text and "with --static a page that runs" in text


def test_a_static_space_says_which_graph_it_bundles():
    parser = parsers()["vit-hub space"]
    (action,) = [action for action in parser._actions if "--static" in action.option_strings]
    text = " ".join(shown_help(parser, action).split())
    assert "pipeline_explain.onnx (the map the app's page opens with, and rollout, drawn over the image)" in text
    assert "else pipeline_map.onnx (rollout)" in text and "else pipeline.onnx" in text


@pytest.mark.parametrize("prog", ["vit-hub export", "python -m vit_hub.export", "vit-hub push"])
def test_the_export_and_push_name_every_file_an_export_ships(prog):
    """export --help says what an export writes and push --help what --with-onnx uploads: each of
    vit_hub.layout's ONNX files by its name (push never uploads the int8 graph: it says so)."""
    layout = ModelDir(Path()).export
    text = " ".join(parsers()[prog].format_help().split())
    named = [path.name for path in (*layout.onnx_files, layout.int8) if path.name not in text]
    assert named == [], text
    if prog == "vit-hub push":
        assert f"(never {layout.int8.name})" in text


@pytest.mark.parametrize("prog", ["vit-hub train", "vit-hub sweep", "vit-hub eval", "vit-hub inspect"])
def test_data_lists_what_it_accepts(prog):
    parser = parsers()[prog]
    (action,) = [action for action in parser._actions if "--data" in action.option_strings]
    text = shown_help(parser, action)
    assert "folder" in text and "mnist" in text
    assert all(name in text for name in TORCHVISION_DATASETS), text


@pytest.mark.parametrize("prog", ["vit-hub train", "vit-hub sweep", "vit-hub info"])
def test_preset_lists_each_preset_with_its_size(prog):
    parser = parsers()[prog]
    (action,) = [action for action in parser._actions if "--preset" in action.option_strings]
    text = shown_help(parser, action)
    for name, values in PRESETS.items():
        assert f"{name} ({values['image_size']} px" in text, text


def test_param_lists_every_name_it_accepts():
    parser = parsers()["vit-hub sweep"]
    (action,) = [action for action in parser._actions if "--param" in action.option_strings]
    text = shown_help(parser, action)
    assert all(name in text for name in MODEL_FIELDS + TRAINING_FIELDS), text


def test_the_installed_commands_print_it():
    """The console script and `python -m vit_hub.export` print the same help, and app.py its own."""
    for command in ([str(Path(sys.executable).parent / "vit-hub"), "train", "--help"],
                    [sys.executable, "-m", "vit_hub.export", "--help"], [sys.executable, "app.py", "--help"]):
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0 and "default" in done.stdout and "Traceback" not in done.stderr, done.stderr
