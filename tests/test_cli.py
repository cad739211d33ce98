"""The `moecast` command itself: its command list, group help, per-command help, strict JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moecast.cli import COMMANDS, main


def test_command_list_describes_each_command_without_importing_torch():
    code = "import sys; from moecast.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    lines = out.strip().splitlines()
    assert lines[-1] == "False"  # `moecast --help` stays fast
    assert any(line.split()[:1] == ["replay"] and "Replay a TraceSet" in line for line in lines)
    assert any(line.split()[:2] == ["traces", "merge"] and "Merge TraceSets" in line for line in lines)
    names = {n for n in COMMANDS}
    assert names <= {line.split()[0] for line in lines[3:-1]}


def test_group_help_lists_its_commands(capsys):
    main(["traces", "--help"])
    out = capsys.readouterr().out
    assert "moecast traces info" in out and "moecast traces merge" in out


def test_command_help_shows_the_whole_description(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    # the paragraph after the first line (every preset with its help, from POLICIES), before the options
    from moecast.runtime.core.policy import POLICIES

    assert all(f"{n} ({p.help})" in " ".join(out.split()) for n, p in POLICIES.items())
    assert out.index("Policies:") < out.index("options:") and "<POLICY" not in out


def test_eval_accuracy_reads_workloads_from_a_data_dir_and_checks_the_plot_path_first(tmp_path):
    from moecast.collect.fixtures import write_fixtures
    from moecast.runtime.live.commands import eval_accuracy, heldout_rows

    data = write_fixtures(tmp_path / "data", rows=4, names=["gsm8k"])
    chars = lambda text: {"input_ids": [ord(c) for c in text]}  # noqa: E731
    rows = heldout_rows(chars, "gsm8k", texts=3, tokens=16, data_dir=str(data))  # no hub download
    from moecast.collect.workloads import get_spec, load_requests

    prompts = [r.prompt for r in load_requests(get_spec("gsm8k"), str(data), limit=3)]
    assert rows == [[ord(c) for c in p[:16]] for p in prompts] and len(rows) == 3
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="not a writable file path") as exc:
        eval_accuracy(model="no-such-model-is-loaded", plot=str(blocker / "x.png"))  # before loading it
    assert "\n" not in str(exc.value)


def test_strict_json_turns_undefined_numbers_into_null():
    import numpy as np

    from moecast.jsonout import dumps

    text = dumps({"a": float("nan"), "b": [np.float32(np.inf), 1.5], "c": np.int64(3)})

    def refuse(name):
        raise ValueError(name)

    assert json.loads(text, parse_constant=refuse) == {"a": None, "b": [None, 1.5], "c": 3}


def test_json_stdout_stays_clean_when_the_encoder_loads_under_offline_wandb():
    # transformers prints "[INFO] Running in WANDB offline mode" to stdout when sentence-transformers
    # loads its trainer integrations; stdout carries `predictors eval ... --json`
    code = "from moecast.predictors.sentence_encoder import _sentence_transformer_class as f; f()"
    env = {**os.environ, "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout == ""


def _echo(max_requests: int = 0) -> dict:
    """A stand-in command whose options the parser checks."""
    return {"max_requests": max_requests}


def test_a_wrong_option_or_command_is_one_line_naming_the_help(monkeypatch):
    from moecast.cli import run
    from moecast.errors import InputError

    monkeypatch.setitem(COMMANDS, "echo", "test_cli:_echo")
    with pytest.raises(InputError) as exc:
        run(["echo", "--nope", "1"])
    msg = str(exc.value)
    assert (
        msg.startswith("moecast echo: ") and msg.endswith("(see `moecast echo --help`)") and "\n" not in msg
    )
    with pytest.raises(InputError, match=r"^unknown command 'nope'; run `moecast --help` for the list$"):
        run(["nope"])
    with pytest.raises(InputError, match=r"^choose a `moecast traces` command: info, merge \(e\.g\."):
        run(["traces", "nope"])
    with pytest.raises(SystemExit) as done:
        main(["traces"])
    assert str(done.value.code).startswith("moecast: error: choose a `moecast traces` command")
