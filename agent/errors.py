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


class DiagRunError(Exception):
    """A job diag itself ran (the demo, a benchmark) failed: one line saying which part and
    how, printed as `diag: error: <message>` with exit status 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


# Characters a terminal acts on instead of showing: C0 controls but tab, newline and
# carriage return (progress bars), DEL, C1 controls, and the bidirectional overrides that
# reorder what a reader sees. Untrusted names (kernels, hosts, file contents) reach
# messages; on a terminal each of these is shown as its escape instead.
_HIDDEN = [c for c in range(0x20) if c not in (0x09, 0x0A, 0x0D)] + list(range(0x7F, 0xA0)) \
    + list(range(0x202A, 0x202F)) + list(range(0x2066, 0x206A))
_VISIBLE = {c: f"\\u{c:04x}" if c > 0xFF else f"\\x{c:02x}" for c in _HIDDEN}


def visible(text: str) -> str:
    """The text with every character a terminal would act on written as its escape."""
    return text.translate(_VISIBLE)


def raw_stream(stream):
    """The stream under a VisibleStream (a view that escapes every string itself writes there)."""
    return stream._stream if isinstance(stream, VisibleStream) else stream


class VisibleStream:
    """A text stream that writes `visible` text: what `diag` prints can move no cursor,
    set no title and hide no text, whatever names it quotes."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(visible(text))
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)
