"""The one exception type that means "the user gave us something wrong" (printed, never a traceback), and the
file system errors that are said the same way."""

import errno


class LaionkitError(Exception):
    """A user-facing error: bad input, bad option, missing file. The CLI prints it and exits 2."""


# A file system that refuses a write: full, over quota, read-only, a file's size limit, no permission, or a path
# through a regular file; said by errno or, where a library rewraps it (pyarrow), only in words.
WRITE_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM, errno.ENOTDIR)
WRITE_REFUSED_WORDS = ("No space left on device", "Disk quota exceeded", "Read-only file system", "File too large")


def write_refused(error: BaseException) -> bool:
    """Whether ``error`` is the file system refusing a write (or a read: no permission): a disk or a path to
    change, not a bug to trace."""
    return isinstance(error, OSError) and (error.errno in WRITE_REFUSED
                                           or any(word in str(error) for word in WRITE_REFUSED_WORDS))


def write_refused_line(error: OSError, target: object = None) -> str:
    """One line for a write_refused error: the file (``target`` being written, else the one the error names), what
    the file system said, and what to do."""
    where = f"cannot write {target}: " if target is not None else f"{error.filename}: " if error.filename else ""
    said = " ".join((error.strerror or str(error)).split())
    return (f"{where}{said}: the file system refused it (full, read-only, or "
            "not a folder you may write); free space or give a path you can write to, then rerun (a stage resumes "
            "from what it finished)")
