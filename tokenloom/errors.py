"""User-facing errors: anything the user can fix raises :class:`TokenloomError`, printed by the
CLI on one line without a traceback; ``assert`` is for internal invariants only.
"""


class TokenloomError(Exception):
    """An error caused by the user's input; the message says what and where."""

    exit_code = 1


class FormatError(TokenloomError):
    """A file does not follow the on-disk format it claims to."""


class Stopped(TokenloomError):
    """A command stopped on a signal after saving what resumes it; exit status ``128 + signal``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + int(signum)
