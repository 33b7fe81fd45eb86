"""The one base class for a mistake the user can fix: a bad path, flag, file or upload.

The command lines (`vit-hub`, `python -m vit_hub.export`, `app.py`) print a `UserError` as one line
and the app shows it on the page; anything else is a bug and keeps its traceback. It is a
`ValueError`, so Python callers that catch `ValueError` keep working. `DataError` is the
data modules' own kind (data, folders, augmentation), defined here below all of them.
"""


class UserError(ValueError):
    """Something the user gave was not what was expected; the message says what was expected
    and what was found."""


class DataError(UserError):
    """A dataset that cannot be used as given (a folder without classes, an unreadable image
    with --strict, a split the source lacks); the message says what was expected."""
