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
from moecast.predictors.provenance import holdout, warn_in_sample


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


def _header(ts, tmp_path, name, **record):
    """A frequency checkpoint fitted on ``ts``'s default train side whose header says only ``record``
    of what it was fitted on (as a contributor's fit that copies no split would write it)."""
    from moecast.predictors import checkpoint

    pred = FrequencyPredictor.fit(ts, ts.splits().train)
    meta = {k: v for k, v in pred.metadata().items() if k not in ("split", "trained_on")}
    return str(checkpoint.save(tmp_path / name, pred.tensors(), {**meta, **record}))


def test_a_checkpoint_that_records_no_split_is_never_scored_as_held_out(two_sets, tmp_path, capsys):
    """Fitted on a's train side, its header saying only where (``trained_on``) or nothing: every
    request of a is scored and said to be possibly in-sample. It was taken for an earlier moecast's
    ungrouped split (scored on that split's val side, which holds grouped-train requests) and, with
    no record, for a checkpoint of another TraceSet ("none of them was trained on")."""
    a, _ = two_sets
    for ckpt in (
        _header(a, tmp_path, "where.safetensors", trained_on=str(a.path)),
        _header(a, tmp_path, "nothing.safetensors"),
    ):
        res = evaluate(ckpt, traces=str(a.path))
        out = capsys.readouterr().out
        assert res["split"] == "all" and res["requests"] == 20, ckpt
        assert f"note: {ckpt} records no training split, so these figures may be in-sample" in out
        assert "none of them was trained on" not in out and "ungrouped" not in out
        with pytest.raises(ValueError, match="records no training split") as exc:
            holdout(a, "test", [ckpt])  # --holdout test would call them held out
        assert "\n" not in str(exc.value)
        with pytest.warns(UserWarning, match=f"{ckpt} records no training split, so the replay's figures"):
            warn_in_sample(a, [ckpt], list(a.request_ids))


def test_only_a_methodless_split_is_the_legacy_one(two_sets, tmp_path, capsys):
    """{val_fraction, seed} without a method is an earlier moecast's split (scored on its val side); a
    split with a method this moecast does not know is no split it can read, not a legacy one."""
    a, _ = two_sets
    other = {"method": "some-future-method", "val_fraction": 0.25, "seed": 0, "traceset_id": a.traceset_id}
    ckpt = _header(a, tmp_path, "future.safetensors", trained_on=str(a.path), split=other)
    res = evaluate(ckpt, traces=str(a.path))
    assert res["split"] == "all" and res["requests"] == 20
    assert "records no training split" in capsys.readouterr().out


def test_the_baselines_fit_records_the_split_it_was_fitted_on(two_sets, tmp_path, capsys):
    """Every kind fitted from traces records its split at fit (not only `predictors eval --save`): on
    the default split's train side that split (its test side then scored), on every request of a
    their TraceSet and count (every request of a then in-sample, all of b held out)."""
    from moecast.predictors.provenance import FITTED_REQUESTS
    from moecast.predictors.registry import fitted_kinds

    a, b = two_sets
    sides = a.splits()
    assert fitted_kinds()  # frequency, hot, moe-infinity, cooccurrence at least
    for kind, cls in fitted_kinds().items():
        split = cls.fit(a, sides.train).meta["split"]
        assert split == {**sides.metadata(), "train_requests": len(sides.train)}, kind
        assert split["method"] == "prompt-groups-v1" and split["traceset_id"] == a.traceset_id
    ckpt = str(FrequencyPredictor.fit(a, sides.train).save(tmp_path / "train.safetensors"))
    res = evaluate(ckpt, traces=str(a.path), json=True)
    assert res["split"] == "test" and res["requests"] == len(sides.test) > 0
    whole = FrequencyPredictor.fit(a, a.request_ids)
    assert whole.meta["split"] == {
        "method": FITTED_REQUESTS,
        "traceset_id": a.traceset_id,
        "train_requests": 20,
    }
    ckpt = str(whole.save(tmp_path / "all.safetensors"))
    capsys.readouterr()
    res = evaluate(ckpt, traces=str(a.path))
    assert res["split"] == "all" and res["requests"] == 20
    assert f"{ckpt} was fitted on 20 requests of this TraceSet that are no split's train side" in (
        " ".join(capsys.readouterr().out.split())
    )
    res = evaluate(ckpt, traces=str(b.path))
    assert res["split"] == "all" and res["requests"] == 7
    assert "none of them was trained on" in capsys.readouterr().out


def test_eval_save_records_the_split_it_scored_not_the_default(two_sets, tmp_path):
    """`predictors eval frequency --val-fraction 0.2 --test-fraction 0.2 --seed 3 --save`: fitted on
    that split's train side, which fit alone cannot tell from other requests; the saved checkpoint
    records that split, so it is scored on the same test side again."""
    a, _ = two_sets
    sides = a.splits(0.2, 0.2, 3)
    assert not set(sides.train) <= set(a.splits().train)  # not the default split's train side
    out = str(tmp_path / "f.safetensors")
    first = evaluate(
        "frequency", traces=str(a.path), val_fraction=0.2, test_fraction=0.2, seed=3, json=True, save=out
    )
    from moecast.predictors.checkpoint import load_metadata

    assert load_metadata(out)["split"] == {**sides.metadata(), "train_requests": len(sides.train)}
    again = evaluate(out, traces=str(a.path), json=True)
    assert again["split"] == "test" and again["requests"] == first["requests"] == len(sides.test) > 0


def test_a_checkpoint_of_a_source_is_scored_on_the_merged_sets_test_side(two_sets, tmp_path):
    """A set merged from a contains a's requests on the sides a's split gave them (splits hash
    prompts): a checkpoint trained on a's train side is scored on the merged set's test side, never
    on all of it (which would score a's training requests as held out)."""
    from moecast.collect.splits import SplitSpec
    from moecast.collect.traceset import merge
    from moecast.predictors.provenance import TrainedOn, choose

    a, b = two_sets
    m = merge([a.path, b.path], tmp_path / "m")
    assert m.traceset_id not in (a.traceset_id, b.traceset_id) and m.contains_traceset(a.traceset_id)
    chosen = choose(m, TrainedOn(spec=SplitSpec(), traceset_id=a.traceset_id))
    assert chosen.name == "test" and chosen.checkpoint_traceset
    assert chosen.requests == m.splits().test
    assert not set(chosen.requests) & set(a.splits().train)  # none of a's training requests
    assert set(a.splits().test) <= set(chosen.requests)


def test_a_predictor_fitted_on_no_request_scores_every_request_even_on_its_traceset(two_sets):
    """``split`` null (fitted on no request, e.g. router weights read from the model) with
    ``trained_on`` naming this very TraceSet: nothing of it was trained on, so all its requests are
    scored, not only a test side."""
    from moecast.predictors.provenance import choose, record_from_meta

    a, _ = two_sets
    record = record_from_meta({"split": None, "trained_on": str(a.path)})
    assert record.nothing and record.same_traceset(a)
    chosen = choose(a, record)
    assert chosen.name == "all" and chosen.requests == list(a.request_ids) and chosen.train == []
    assert chosen.notes == ["none of them was trained on"] and not chosen.checkpoint_traceset


def test_holdout_replays_a_checkpoint_fitted_on_another_tracesets_requests(two_sets, tmp_path):
    """A checkpoint fitted on every request of b (split method ``requests``, b's id) saw no request
    of a: --holdout test on a replays a's test side of the default split, where a checkpoint with
    no record on a is refused."""
    from moecast.predictors.provenance import FITTED_REQUESTS

    a, b = two_sets
    split = {"method": FITTED_REQUESTS, "traceset_id": b.traceset_id, "train_requests": 7}
    ckpt = _header(b, tmp_path, "b_all.safetensors", split=split)
    held, train = holdout(a, "test", [ckpt])
    sides = a.splits()
    assert held == sides.test and train == sides.train and held
    with pytest.raises(ValueError, match="records no training split"):
        holdout(b, "test", [ckpt])


def test_holdout_share_sizes_the_test_side_when_no_checkpoint_records_a_split(two_sets):
    """--holdout 0.3 with no checkpoint split to follow: the test side of the split with test_fraction
    0.3 (val 0.1, seed 0), not the default 0.1; --holdout test takes the default's."""
    a, _ = two_sets
    wide = a.splits(0.1, 0.3, 0)
    assert wide.test != a.splits().test
    assert holdout(a, 0.3, []) == (wide.test, wide.train)
    assert holdout(a, "test", []) == (a.splits().test, a.splits().train)


def test_a_cascades_relative_eam_path_is_read_beside_the_cascade(two_sets, tmp_path, monkeypatch):
    """A cascade records no split of its own; its EAM file, named relative to the cascade's folder,
    does: trained_on_file reads it there whatever the working directory."""
    from moecast.collect.splits import SplitSpec
    from moecast.predictors import checkpoint
    from moecast.predictors.provenance import trained_on_file

    a, _ = two_sets
    (tmp_path / "ck").mkdir()
    eam, _ = _saved(a, tmp_path / "ck", "eam.safetensors", test_fraction=0.25)
    meta = {k: v for k, v in checkpoint.load_metadata(eam).items() if k not in ("split", "trained_on")}
    cascade = tmp_path / "ck" / "cascade.safetensors"
    checkpoint.save(cascade, {}, {**meta, "kind": "cascade", "files": {"eam": "eam.safetensors"}})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    record = trained_on_file(cascade)
    assert record is not None and record.spec == SplitSpec(0.1, 0.25, 0)
    assert record.traceset_id == a.traceset_id
