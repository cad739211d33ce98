"""Which requests a checkpoint is scored on: its own split's test side on its TraceSet, all of
another TraceSet, never a split that disagrees with the one it was trained on."""

from __future__ import annotations

import json
import warnings

import pytest
from conftest import make_synthetic_traceset
from moecast.collect.traceset import TraceSet
from moecast.predictors.baselines import FrequencyPredictor
from moecast.predictors.commands import evaluate
from moecast.predictors.provenance import holdout


@pytest.fixture
def two_sets(tmp_path):
    a = TraceSet(make_synthetic_traceset(tmp_path / "a", num_requests=20, seed=0))
    b = TraceSet(make_synthetic_traceset(tmp_path / "b", num_requests=7, seed=1))
    assert a.traceset_id != b.traceset_id and a.model.fingerprint == b.model.fingerprint
    return a, b


def _saved(ts, tmp_path, name="freq.safetensors", **spec):
    """A frequency checkpoint trained on ``ts``'s train side, with that split recorded."""
    sides = ts.splits(**spec)
    pred = FrequencyPredictor.fit(ts, sides.train)
    pred.meta["split"] = sides.metadata()
    return str(pred.save(tmp_path / name)), sides


def test_eval_scores_test_on_the_training_traceset_and_all_elsewhere(two_sets, tmp_path, capsys):
    a, b = two_sets
    ckpt, sides = _saved(a, tmp_path, val_fraction=0.2, test_fraction=0.2, seed=3)
    own = evaluate(ckpt, traces=str(a.path), json=True)
    assert own["split"] == "test" and own["requests"] == len(sides.test) > 0
    assert own["checkpoint_traceset"] and own["split_spec"]["test_fraction"] == 0.2
    assert own["split_spec"]["seed"] == 3
    val = evaluate(ckpt, traces=str(a.path), split="val", json=True)
    assert val["requests"] == len(sides.val)
    other = evaluate(ckpt, traces=str(b.path), json=True)
    assert other["split"] == "all" and other["requests"] == b.num_requests
    assert not other["checkpoint_traceset"]
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["split"] == "all"
    with pytest.raises(ValueError, match="disagrees with the split"):
        evaluate(ckpt, traces=str(a.path), val_fraction=0.1, json=True)


def test_a_baseline_built_here_fits_on_train_and_reports_test(two_sets, tmp_path):
    a, _ = two_sets
    res = evaluate("frequency", traces=str(a.path), json=True, save=str(tmp_path / "f.safetensors"))
    sides = a.splits()
    assert res["split"] == "test" and res["requests"] == len(sides.test)
    again = evaluate(str(tmp_path / "f.safetensors"), traces=str(a.path), json=True)
    assert again["requests"] == len(sides.test)
    assert again["recall_at_k"] == pytest.approx(res["recall_at_k"])  # the same table, the same requests


def test_a_checkpoint_of_the_ungrouped_split_scores_its_val_and_says_so(two_sets, tmp_path, capsys):
    a, _ = two_sets
    train, val = a.split(0.25, 0)
    pred = FrequencyPredictor.fit(a, train)
    pred.meta["split"] = {"val_fraction": 0.25, "seed": 0}
    ckpt = str(pred.save(tmp_path / "old.safetensors"))
    res = evaluate(ckpt, traces=str(a.path))
    assert res["split"] == "val" and res["requests"] == len(val)
    assert "ungrouped split" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no test split"):
        evaluate(ckpt, traces=str(a.path), split="test")
    with pytest.raises(ValueError, match="ungrouped split"):
        holdout(a, "test", [ckpt])


def test_replay_holdout_takes_the_checkpoint_split_and_refuses_another(two_sets, tmp_path, capsys):
    a, _ = two_sets
    ckpt, sides = _saved(a, tmp_path, test_fraction=0.25)
    held, train = holdout(a, "test", [ckpt])
    assert held == sides.test and train == sides.train
    assert holdout(a, 0.25, [ckpt])[0] == sides.test
    with pytest.raises(ValueError, match="disagrees"):
        holdout(a, 0.1, [ckpt])
    other, _ = _saved(a, tmp_path, "other.safetensors", test_fraction=0.1)
    with pytest.raises(ValueError, match="different splits"):
        holdout(a, "test", [ckpt, other])
    with pytest.raises(ValueError, match="--holdout must be"):
        holdout(a, "everything", [])
    from moecast.cli import main

    argv = ["replay", "--traces", str(a.path), "--policy", "prefetch", "--predictor", ckpt, "--capacity", "4"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--holdout", "0.1"])
    assert "disagrees" in str(exc.value.code) and "\n" not in str(exc.value.code)
    main([*argv, "--holdout", "test", "--json", "true"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["requests"] == len(sides.test)


def test_replay_without_holdout_says_it_scores_a_checkpoint_in_sample(two_sets, tmp_path, capsys):
    """Every request replayed, the checkpoint's train and val sides among them: one warning line with
    their count, counted here from the split; none with --holdout test, nor on another TraceSet."""
    from moecast.cli import main

    a, b = two_sets
    ckpt, sides = _saved(a, tmp_path, test_fraction=0.25)
    seen = len(sides.train) + len(sides.val)
    base = ["--policy", "prefetch", "--predictor", ckpt, "--capacity", "4", "--json", "true"]
    main(["replay", "--traces", str(a.path), *base])
    err = capsys.readouterr().err
    assert err.count("moecast: warning:") == 1
    assert f"warning: {seen} of the {len(a.request_ids)} replayed requests are {ckpt}'s training or" in err
    main(["replay", "--traces", str(a.path), *base, "--holdout", "test"])
    main(["replay", "--traces", str(b.path), *base])  # no request of b was seen in training
    assert "warning" not in capsys.readouterr().err
    with warnings.catch_warnings():  # the same line again in this process: Python shows it once
        warnings.simplefilter("always")
        main(["compare", "--traces", str(a.path), "--predictors", ckpt, "--policies", "prefetch", "--capacities",
              "4", "--out", str(tmp_path / "cmp"), "--wandb", "false", "--json"])  # fmt: skip
    assert "training or validation requests (in-sample figures)" in capsys.readouterr().err
