"""Errors meant for the user: printed as one message, never as a traceback."""

# Set by `pipeline.launch` for the command it runs: where `pipeline.cli` appends the message
# of a failure (each separated by a NUL line), so the launcher can show it on the terminal.
ERROR_FILE_ENV = "SFT_ERROR_FILE"


class UserError(Exception):
    """Bad input or configuration. The message names the file, record or key."""

    exit_code = 2


class DataError(UserError):
    """The dataset failed validation; details are in the validation report."""

    exit_code = 3
