"""The one exception type that means "the user gave us something wrong" (printed, never a traceback)."""


class LaionkitError(Exception):
    """A user-facing error: bad input, bad option, missing file. The CLI prints it and exits 2."""
