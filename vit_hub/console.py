"""What every command line here shares (`vit-hub`, `python -m vit_hub.export`, `app.py`): a usage
error or a user's mistake is one line on stderr and an exit code, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from .errors import UserError

# Errors a user can cause (a bad value, file or upload, a path that is not there or not
# theirs); printed as one line. Any other exception is a bug and keeps its traceback.
USER_ERRORS = (UserError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


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
