"""User errors print one line; anything else is a bug and keeps its traceback (moecast/errors.py)."""

from __future__ import annotations

import errno

import pytest
from moecast.collect.models import ModelLoadError
from moecast.collect.traceset import MissingFieldError, TraceSetError
from moecast.collect.workloads import WorkloadError
from moecast.predictors.checkpoint import CheckpointError
from moecast.runtime.cost_model import ProfileError

from moecast.errors import InputError, MoecastError, run_command, user_errors


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("MOECAST_DEBUG", raising=False)


def _raise(exc: BaseException):
    def call():
        raise exc

    return call


@pytest.mark.parametrize(
    "cls",
    [
        InputError,
        TraceSetError,
        MissingFieldError,
        CheckpointError,
        ProfileError,
        WorkloadError,
        ModelLoadError,
    ],
)
def test_every_input_check_raises_a_moecast_error(cls):
    assert issubclass(cls, MoecastError)
    assert issubclass(cls, user_errors())


def test_input_error_is_a_value_error_for_python_callers():
    with pytest.raises(ValueError, match="bad"):
        raise InputError("bad")


def test_a_user_error_prints_its_first_line_only():
    with pytest.raises(SystemExit) as exc:
        run_command(_raise(InputError("--k must be 1 to 8, not 0\nsecond line")))
    assert exc.value.code == "moecast: error: --k must be 1 to 8, not 0"


def test_an_os_error_names_the_path_and_what_to_do(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as exc:
        run_command(_raise(FileNotFoundError(errno.ENOENT, "No such file or directory", str(missing))))
    msg = str(exc.value.code)
    assert msg.startswith("moecast: error: [Errno 2]") and str(missing) in msg
    assert msg.endswith("check the path, or create what it names first")


@pytest.mark.parametrize(
    "bug",
    [KeyError("x"), ValueError("bad shape"), RuntimeError("boom"), TypeError("wrong type"), IndexError(3)],
)
def test_a_bug_keeps_its_traceback(bug):
    with pytest.raises(type(bug)):
        run_command(_raise(bug))


def test_debug_mode_shows_the_traceback_of_a_user_error(monkeypatch):
    monkeypatch.setenv("MOECAST_DEBUG", "1")
    with pytest.raises(InputError):
        run_command(_raise(InputError("bad")))


def test_the_command_line_reports_a_checked_input_in_one_line(tmp_path, capsys):
    from moecast.cli import main

    not_a_ckpt = tmp_path / "x.safetensors"
    not_a_ckpt.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as exc:
        main(["predictors", "eval", str(not_a_ckpt), "--traces", str(tmp_path / "none")])
    msg = str(exc.value.code)
    assert msg.startswith("moecast: error: ") and "\n" not in msg
