"""User errors print one line; anything else is a bug and keeps its traceback (moecast/errors.py)."""

from __future__ import annotations

import errno

import pytest
from moecast.collect.models import ModelLoadError
from moecast.collect.traceset import MissingFieldError, TraceSetError
from moecast.collect.workloads import WorkloadError
from moecast.predictors.checkpoint import CheckpointError
from moecast.runtime.core.cost_model import ProfileError

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


def test_moecasts_warnings_print_one_line_and_others_as_python_shows_them(capsys):
    import warnings

    from moecast.runtime.tiers.precision import PrecisionWarning

    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("int4 group size 128 does not divide\nsecond line", PrecisionWarning, stacklevel=1)
            warnings.warn("a library's", FutureWarning, stacklevel=1)
        return 7

    shown = warnings.showwarning
    with pytest.warns(FutureWarning, match="a library's"):  # handed on to the handler before it
        assert run_command(call) == 7
    assert warnings.showwarning is shown  # restored after the command
    assert capsys.readouterr().err.splitlines() == ["moecast: warning: int4 group size 128 does not divide"]


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


def test_as_flags_turns_the_settings_a_command_takes_into_its_flags():
    from moecast.errors import as_flags

    msg = "offload='disk' needs offload_dir=DIR (x); lower capacity=N, not alpha=0.3; keep io_threads"
    names = ["offload", "offload_dir", "capacity"]
    assert (
        as_flags(msg, names)
        == "--offload disk needs --offload-dir DIR (x); lower --capacity N, not alpha=0.3; keep io_threads"
    )
    assert as_flags(msg, []) == msg  # a name the command does not take stays the keyword


def test_attach_names_the_keyword_and_the_command_the_flag(tmp_path, capsys):
    """The same check, raised through attach(), reads as the Python call is written; through
    `moecast run` as the command line is typed."""
    from moecast.collect.tiny import build_tiny
    from moecast.runtime.live.runtime import attach
    from test_live import make_model

    from moecast.cli import main

    with pytest.raises(InputError) as exc:
        attach(make_model("qwen2_moe"), offload="disk")
    assert "offload='disk' needs offload_dir=DIR" in str(exc.value) and "--" not in str(exc.value)
    with pytest.raises(
        InputError, match=r"prefetch='predictor' needs a predictor checkpoint \(predictor=CKPT\)"
    ):
        attach(make_model("qwen2_moe"), prefetch="predictor", policy="lru", capacity=0.5)
    tiny = build_tiny(out=str(tmp_path / "tiny"), preset="test", seed=0)
    with pytest.raises(
        SystemExit, match=r"--prefetch predictor needs a predictor checkpoint \(--predictor CKPT\)"
    ):
        main(
            [
                "run",
                "--model",
                str(tiny),
                "--max-new-tokens",
                "1",
                "--policy",
                "lru",
                "--prefetch",
                "predictor",
            ]
        )


def test_attach_takes_the_router_pattern(tmp_path):
    """Routers named by a regex, the experts still the interface's: the same logits and counters as
    the routers found by the model's records; a pattern that names nothing is refused in one line,
    as a keyword through attach() and as the flag through `moecast run`."""
    import torch
    from moecast.collect.tiny import build_tiny
    from moecast.runtime.live.runtime import attach
    from test_live import decode_logits, make_model

    from moecast.cli import main

    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(4))
    got = {}
    for pattern in (None, r"mlp\.gate$"):
        rt = attach(model, policy="lru", capacity=0.25, alpha=0.0, router_pattern=pattern)
        try:
            got[pattern] = (
                decode_logits(model, ids),
                rt.stats()["hits"],
                [e.router_name for e in rt.structure.layers],
            )
        finally:
            rt.detach()
    assert torch.equal(got[None][0], got[r"mlp\.gate$"][0]) and got[None][1:] == got[r"mlp\.gate$"][1:]
    with pytest.raises(ModelLoadError, match="router_pattern='no_such' matches no module"):
        attach(model, router_pattern="no_such")
    tiny = build_tiny(out=str(tmp_path / "tiny"), preset="test", seed=0)
    with pytest.raises(SystemExit, match="--router-pattern no_such matches no module"):
        main(["run", "--model", str(tiny), "--max-new-tokens", "1", "--router-pattern", "no_such"])


def test_output_piped_into_head_ends_quietly_with_status_0(monkeypatch):
    """`moecast ... | head` closes the pipe: a success for the user, so no error line and exit 0."""
    import io

    class Kept(io.StringIO):
        """Keeps what was written after the code closes it."""

        said = ""

        def close(self) -> None:
            self.said = self.getvalue()
            super().close()

    err = Kept()
    monkeypatch.setattr("sys.stderr", err)
    with pytest.raises(SystemExit) as exc:
        run_command(_raise(BrokenPipeError()))
    assert exc.value.code == 0
    assert (err.said if err.closed else err.getvalue()) == ""


def test_an_interrupt_exits_with_one_line_saying_how_to_resume():
    with pytest.raises(SystemExit) as exc:
        run_command(_raise(KeyboardInterrupt()))
    assert exc.value.code == "moecast: interrupted; re-run the same command to resume"
