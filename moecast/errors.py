"""One-line errors for users: expected failures print what is wrong and what to do, no traceback.

A user error is a :class:`MoecastError` (raised where input is checked: :class:`InputError`,
``TraceSetError``, ``CheckpointError``, ``WorkloadError``, ``ModelLoadError``, ``ProfileError``)
or an ``OSError`` about a path. Anything else is a bug, and the command shows its traceback.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any


class MoecastError(Exception):
    """Base for errors a user can fix; the message says how."""


class InputError(MoecastError, ValueError):
    """A setting, file or argument the user gave is wrong; a ValueError too, so callers that
    validate through the Python API catch it as they would any bad value."""


# What to do about a file-system error, by errno: the OS message names the path but not the fix.
_OS_HINTS: dict[int, str] = {
    errno.ENOENT: "check the path, or create what it names first",
    errno.EEXIST: "something is already at that path; remove it or choose another path",
    errno.ENOTDIR: "a part of that path is a file, not a directory; choose another path",
    errno.EISDIR: "that path is a directory; give a file path",
    errno.EACCES: "choose a path you may write, or fix its permissions",
    errno.EPERM: "choose a path you may write, or fix its permissions",
    errno.EROFS: "that file system is read-only; choose a writable path",
    errno.ENOSPC: "the disk is full; free some space or choose a path on another disk",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ENOTEMPTY: "the directory is not empty; empty it or choose another path",
}


def as_flags(message: str, names: Iterable[str]) -> str:
    """A library message as the command line says it: each setting it names as a Python keyword
    (``offload_dir=DIR``, ``policy='static'``) becomes the flag (``--offload-dir DIR``,
    ``--policy static``). Errors raised through the Python API name keywords, so a caller of
    ``attach()`` reads the name it passes; the command's user reads the flag it types."""
    known = "|".join(sorted((re.escape(n) for n in names), key=len, reverse=True))
    if not known:
        return message

    def flag(m: re.Match) -> str:
        return f"--{m.group(1).replace('_', '-')} {m.group(3)}"

    return re.sub(rf"(?<![\w-])({known})=(['\"]?)([^\s'\",;)]*)\2", flag, message)


def user_errors() -> tuple[type[BaseException], ...]:
    # OSError covers every file-system failure (missing, exists, not a directory, permission, disk
    # full): the user fixes the path, so a traceback would only hide the message. Any other error
    # (a ValueError or KeyError included) is a bug and keeps its traceback.
    return (MoecastError, OSError)


def _message(exc: BaseException) -> str:
    msg = str(exc)
    # an error the OS raised carries errno and the path; ours carry a full sentence and no errno
    if isinstance(exc, OSError) and exc.errno is not None and exc.filename is not None:
        hint = _OS_HINTS.get(exc.errno, "check the path and try again")
        msg = f"{msg}: {hint}"
    return msg


def _show_warning(
    before: Callable[..., Any],
    message: Any,
    category: type,
    filename: str,
    lineno: int,
    file: Any = None,
    line: Any = None,
) -> None:
    """moecast's own warnings (a precision run otherwise than asked, buffered reads) as one line, as its
    errors are; anything else to the handler ``before`` it."""
    if category.__module__.split(".")[0] == "moecast" and not os.environ.get("MOECAST_DEBUG"):
        print(f"moecast: warning: {str(message).splitlines()[0]}", file=sys.stderr if file is None else file)
    else:
        before(message, category, filename, lineno, file, line)


def run_command(call: Callable[[], Any]) -> Any:
    shown = warnings.showwarning
    warnings.showwarning = functools.partial(_show_warning, shown)
    try:
        return _run(call)
    finally:
        warnings.showwarning = shown


def _run(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except BrokenPipeError:  # output piped into `head`
        sys.stderr.close()
        sys.exit(0)
    except KeyboardInterrupt:
        sys.exit("moecast: interrupted; re-run the same command to resume")
    except user_errors() as exc:
        if os.environ.get("MOECAST_DEBUG"):
            raise
        msg = _message(exc)
        sys.exit(f"moecast: error: {msg.splitlines()[0] if msg else type(exc).__name__}")
