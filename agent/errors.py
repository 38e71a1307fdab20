"""Errors that mean "bad input", reported to the user as one line, never a traceback."""


class DiagInputError(Exception):
    """Input the user gave us cannot be used: corrupt trace, foreign log, empty directory.

    The message is one line and names the file and the problem. The CLI prints it
    as `diag: error: <message>` and exits with status 2.
    """

    def __init__(self, message: str, source: str | None = None):
        self.source = source
        text = f"{source}: {message}" if source else message
        super().__init__(" ".join(text.split()))
