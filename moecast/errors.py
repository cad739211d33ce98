"""One-line errors for users: expected failures print what is wrong and what to do, no traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


class MoecastError(Exception):
    """Base for errors a user can fix; the message says how."""


def user_errors() -> tuple[type[BaseException], ...]:
    from moecast.collect.traceset import TraceSetError

    return (MoecastError, TraceSetError, FileNotFoundError, ValueError, KeyError, NotADirectoryError)


def run_command(call: Callable[[], Any]) -> Any:
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
        msg = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        sys.exit(f"moecast: error: {msg.splitlines()[0] if msg else type(exc).__name__}")
