"""What every command line here shares (`vit-hub`, `python -m vit_hub.export`, `app.py`): a usage
error or a user's mistake is one line on stderr and an exit code, never a traceback; and flags
made from a dataclass's fields (`add_field_flags`: type, choices, help and default from the
field), so each setting is written once."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import unicodedata
from inspect import cleandoc
from typing import Any, Callable

from vit_hub.errors import UserError

# Errors a user can cause (a bad value, file or upload, a path that is not there or not
# theirs); printed as one line. Any other exception is a bug and keeps its traceback.
USER_ERRORS = (UserError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def escaped(text: str) -> str:
    """Untrusted text (a label, a lock file's line) as printed to a terminal: each control,
    format or line-separating character written as its escape (`\\n`, `\\x1b`, `\\u202e`), so
    the text can neither start a line of its own nor move the cursor or recolour the output."""
    return "".join(char.encode("unicode_escape").decode("ascii") if is_control(char) else char for char in text)


def is_control(char: str) -> bool:
    """A character that steers a terminal or text layout instead of showing: Unicode's control,
    format, surrogate, private-use and unassigned characters and the line and paragraph separators."""
    return unicodedata.category(char)[0] == "C" or unicodedata.category(char) in ("Zl", "Zp")


def default_text(value: Any) -> str:
    """A default as --help shows it: "on" or "off" for a switch, the value itself otherwise."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """--help that gives every optional flag's default: argparse's value, "off" for a switch.
    A flag whose default is worked out later (argparse holds None) says it in its own help.
    Descriptions and epilogs keep their line breaks (the examples)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.required \
                or action.default is None or action.default is argparse.SUPPRESS:
            return text
        shown = default_text(action.default) if isinstance(action.default, bool) else "%(default)s"
        return f"{text} (default: {shown})"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`vit-hub train: error: ...`) without the
    usage block above it; `--help` still shows the usage and every flag's default
    (HelpWithDefaults). Subcommands inherit the class."""

    def __init__(self, *args: Any, formatter_class: type = HelpWithDefaults, **kwargs: Any):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_reporting_errors(action: Callable[[], Any], failed_checks: tuple[type[Exception], ...] = ()) -> int:
    """Run `action()` and return the exit code: 0 when it returns; 2 for a user error and 1
    for one of `failed_checks` (a result that did not verify), each printed as `error: ...`;
    130 for Ctrl-C."""
    try:
        action()
    except KeyboardInterrupt:
        return 130
    except failed_checks as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


# Flags from a dataclass's fields ------------------------------------------------------------
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


# Argument type of a dataclass field, by its annotation (a string under `from __future__ import annotations`).
FLAG_TYPES = {
    "int": int, "int | None": int, "float": float, "float | None": float, "str": str, "str | None": str,
    "int | list[int]": _size, "float | list[float] | None": _floats,
}


def field_help(cls: type) -> dict[str, str]:
    """Each field's description, read from the `Args:` section of the class docstring
    (a line `name: text` or `name, other: text`, continued on more-indented lines)."""
    helps: dict[str, str] = {}
    names: list[str] = []
    for line in cleandoc(cls.__doc__ or "").partition("Args:")[2].splitlines():
        entry = re.fullmatch(r" {4}(\w+(?:, \w+)*): (.*)", line)
        if entry:
            names = entry[1].split(", ")
            helps.update(dict.fromkeys(names, entry[2]))
        elif line.startswith(" " * 8):
            helps.update({name: f"{helps[name]} {line.strip()}" for name in names})
    return helps


def add_field_flags(group, cls: type, names: tuple[str, ...], set_first_by: str = "",
                    notes: dict[str, str] | None = None) -> None:
    """One `--flag-name` per dataclass field in `names`: type from the annotation, choices
    from `one_of`, help from the docstring (plus `notes[name]`). Every flag defaults to None
    (not given), so the dataclass keeps the one copy of each default, which --help shows;
    `set_first_by` names what sets the field before the dataclass default applies."""
    helps = field_help(cls)
    for field in dataclasses.fields(cls):
        if field.name not in names:
            continue
        flag = field.metadata.get("flag", "--" + field.name.replace("_", "-"))
        text = ". ".join(filter(None, [helps.get(field.name, "").rstrip("."), (notes or {}).get(field.name)]))
        text = text.replace("%", "%%")
        text += _default_note(field, set_first_by) if "default" not in text else ""
        options = dict(dest=field.name, default=None, help=text, choices=field.metadata.get("choices"))
        if field.type in ("bool", "bool | None"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
            continue
        if field.type not in FLAG_TYPES:
            raise TypeError(f"{cls.__name__}.{field.name}: no command-line type for the annotation {field.type!r}")
        metavar = None if options["choices"] else flag.lstrip("-").upper().replace("-", "_")
        group.add_argument(flag, type=FLAG_TYPES[field.type], metavar=metavar, **options)


def _default_note(field: dataclasses.Field, set_first_by: str) -> str:
    """' (default: ...)' for a field's flag: the dataclass default, after `set_first_by`."""
    value = None if field.default in (dataclasses.MISSING, "") else field.default
    shown = None if value is None else default_text(value)
    if set_first_by:
        return f" (default: {set_first_by}" + (f", else {shown})" if shown is not None else ")")
    return f" (default: {shown})" if shown is not None else ""
