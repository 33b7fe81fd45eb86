"""What every command line here shares (`vit-hub`, `python -m export`, `app.py`): a usage
error or a user's mistake is one line on stderr and an exit code, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

# Errors a user can cause (a bad path, value or file); printed as one line.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`vit-hub train: error: ...`) without the
    usage block above it; `--help` still shows the usage. Subcommands inherit the class."""

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
