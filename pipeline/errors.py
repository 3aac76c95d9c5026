"""Errors meant for the user: printed as one message, never as a traceback."""


class UserError(Exception):
    """Bad input or configuration. The message names the file, record or key."""

    exit_code = 2


class DataError(UserError):
    """The dataset failed validation; details are in the validation report."""

    exit_code = 3
