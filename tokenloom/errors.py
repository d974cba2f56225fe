"""User-facing errors.

Anything the user can fix (a bad flag, a corrupt or missing file, a bad record)
raises :class:`TokenloomError`; the CLI prints its message on one line and exits
non-zero without a traceback. ``assert`` is kept for internal invariants only.
"""


class TokenloomError(Exception):
    """An error caused by the user's input; the message says what and where."""

    exit_code = 1


class FormatError(TokenloomError):
    """A file does not follow the on-disk format it claims to."""


class Interrupted(TokenloomError):
    """The user stopped the command (Ctrl-C); the message says what was kept and how to go on."""

    exit_code = 130  # 128 + SIGINT, as a shell reports a process that SIGINT ended
