"""The one base class for a mistake the user can fix: a bad path, flag, file or upload.

The command lines (`vit-hub`, `python -m export`, `app.py`) print a `UserError` as one line
and the app shows it on the page; anything else is a bug and keeps its traceback. It is a
`ValueError`, so Python callers that catch `ValueError` keep working.
"""


class UserError(ValueError):
    """Something the user gave was not what was expected; the message says what was expected
    and what was found."""
