"""Metric definitions (docs/design.md, "Metrics") against brute-force and scikit-learn references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moecast.predictors.metrics import (
    MetricAccumulator,
    evaluate_scores,
    multi_hot,
    recall_at_k,
    topk_indices,
)
from sklearn.metrics import f1_score, precision_score


def _random_case(seed: int, T: int = 30, L: int = 3, E: int = 8, k: int = 2):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(T, L, E)).astype(np.float32)
    truth = np.argsort(rng.random((T, L, E)), axis=-1)[..., :k]
    return scores, truth


def test_multi_hot_ignores_padding_and_keeps_real_ids():
    ids = np.array([[0, 3, -1], [-1, 0, 2]])
    hot = multi_hot(ids, 4)
    assert hot.tolist() == [[True, False, False, True], [True, False, True, False]]


def test_recall_matches_brute_force():
    scores, truth = _random_case(0)
    k = truth.shape[-1]
    expected = []
    for t in range(scores.shape[0]):
        for li in range(scores.shape[1]):
            pred = set(np.argsort(-scores[t, li])[:k].tolist())
            expected.append(len(pred & set(truth[t, li].tolist())) / k)
    assert recall_at_k(scores, truth) == pytest.approx(np.mean(expected))


def test_perfect_and_worst_predictions():
    _, truth = _random_case(1)
    perfect = multi_hot(truth, 8, np.float32)
    assert recall_at_k(perfect, truth) == 1.0
    assert recall_at_k(-perfect, truth) == 0.0
    res = evaluate_scores(perfect, truth)
    assert res["f1_micro"] == 1.0 and res["f1_macro"] == 1.0 and res["precision"] == 1.0


def test_smaller_k_counts_share_of_prediction_inside_true_set():
    truth = np.array([[[0, 1, 2, 3]]])
    scores = np.array([[[5.0, 4.0, 0.0, 0.0, 3.0, 0.0]]])  # top-3 = {0, 1, 4}: two inside
    assert recall_at_k(scores, truth, k=3) == pytest.approx(2 / 3)
    assert recall_at_k(scores, truth, k=2) == 1.0


def test_precision_and_f1_agree_with_sklearn():
    scores, truth = _random_case(2, T=50, L=2, E=6, k=2)
    res = evaluate_scores(scores, truth, groups={"a": [0], "b": [1]})
    pred = multi_hot(topk_indices(scores, 2), 6).reshape(-1, 6)
    gold = multi_hot(truth, 6).reshape(-1, 6)
    assert res["precision"] == pytest.approx(precision_score(gold, pred, average="micro"))
    assert res["f1_micro"] == pytest.approx(f1_score(gold, pred, average="micro"))
    # macro: per layer over experts, then over layers
    macro = np.mean(
        [
            f1_score(
                multi_hot(truth[:, li], 6),
                multi_hot(topk_indices(scores[:, li], 2), 6),
                average="macro",
                zero_division=np.nan,
            )
            for li in range(2)
        ]
    )
    assert res["f1_macro"] == pytest.approx(macro)
    assert res["per_group"]["a"]["recall_at_k"] == pytest.approx(recall_at_k(scores[:, 0], truth[:, 0]))
    assert res["per_layer"]["recall_at_k"][1] == pytest.approx(recall_at_k(scores[:, 1], truth[:, 1]))
    for li in range(2):  # per layer: the same definitions on that layer's rows
        g1, p1 = multi_hot(truth[:, li], 6), multi_hot(topk_indices(scores[:, li], 2), 6)
        assert res["per_layer"]["precision"][li] == pytest.approx(precision_score(g1, p1, average="micro"))
        assert res["per_layer"]["f1_micro"][li] == pytest.approx(f1_score(g1, p1, average="micro"))
        assert res["per_layer"]["f1_macro"][li] == pytest.approx(
            f1_score(g1, p1, average="macro", zero_division=np.nan)
        )


def test_accumulator_equals_one_shot():
    scores, truth = _random_case(3, T=40)
    acc = MetricAccumulator(3, 8, 2)
    acc.update(scores[:15], truth[:15])
    acc.update(scores[15:], truth[15:])
    one = evaluate_scores(scores, truth)
    got = acc.result()
    for key in ("recall_at_k", "precision", "f1_micro", "f1_macro"):
        assert got[key] == pytest.approx(one[key])


def test_accumulator_counts_add_across_processes():
    """What DDP validation does: each rank's counts summed give the one-process result."""
    scores, truth = _random_case(4, T=50)
    ranks = [MetricAccumulator(3, 8, 2, extra_k=(1,)) for _ in range(2)]
    ranks[0].update(scores[::2], truth[::2])
    ranks[1].update(scores[1::2], truth[1::2])
    whole = MetricAccumulator(3, 8, 2, extra_k=(1,))
    whole.update(scores, truth)
    merged = MetricAccumulator(3, 8, 2, extra_k=(1,))
    merged.set_counts(ranks[0].counts() + ranks[1].counts())
    assert np.array_equal(merged.counts(), whole.counts())
    assert merged.result({"g": [0, 2]}) == whole.result({"g": [0, 2]})
    with pytest.raises(ValueError, match="counts of shape"):
        merged.set_counts(np.zeros(3))


def test_plan_broadcasts_over_tokens():
    _, truth = _random_case(4)
    plan = np.random.default_rng(0).random((3, 8))  # [L, E] prompt-level plan
    assert recall_at_k(plan, truth) == pytest.approx(recall_at_k(np.broadcast_to(plan, (30, 3, 8)), truth))


def test_bad_inputs_one_clear_error():
    _, truth = _random_case(5)
    bad = np.full((30, 3, 8), np.nan)
    with pytest.raises(ValueError, match="NaN"):
        recall_at_k(bad, truth)
    with pytest.raises(ValueError, match="empty split"):
        MetricAccumulator(3, 8, 2).result()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4))
def test_recall_in_unit_interval(seed, k):
    scores, truth = _random_case(seed, T=5, k=k)
    r = recall_at_k(scores, truth)
    assert 0.0 <= r <= 1.0


def test_recall_past_the_true_sets_size_divides_by_the_true_set():
    """Scores [.9, .8, .7, .1], true experts {0, 3}: the top 3 hold 0 only, 1 of 2: 0.5; the top 4 hold
    both: 1.0 (dividing by k would give 1/3 and 1/2)."""
    from moecast.predictors.metrics import MetricAccumulator, recall_at_k

    s = np.array([[0.9, 0.8, 0.7, 0.1]])
    t = np.array([[0, 3]])
    assert recall_at_k(s, t, k=3) == 0.5 and recall_at_k(s, t, k=4) == 1.0
    acc = MetricAccumulator(1, 4, 2, extra_k=(3,))
    acc.update(s[:, None], t[:, None])
    assert acc.result()["recall_at_3"] == 0.5


def test_precision_recall_and_f1_when_k_exceeds_the_true_set():
    """Pins the accumulator's recall@k denominator min(k, k_true) and precision = TP / (TP + FP) where
    FP != FN (every other test has k == k_true, where FP and FN are equal in total).

    By hand: scores [4, 3, 2, 1], true {0, 1}, k = 4: predicted {0, 1, 2, 3}, TP 2, FP 2, FN 0.
    recall@4 = 2 / min(4, 2) = 1.0; precision = 2 / 4 = 0.5; recall = 2 / 2 = 1.0;
    f1_micro = 2 * 0.5 * 1 / 1.5 = 2/3. Catches M4 (recall divided by k: 0.5) and M5 (precision
    computed as TP / (TP + FN): 1.0)."""
    res = evaluate_scores(np.array([[[4.0, 3.0, 2.0, 1.0]]]), np.array([[[0, 1]]]), k=4)
    assert res["recall_at_k"] == 1.0
    assert res["precision"] == 0.5
    assert res["recall"] == 1.0
    assert res["f1_micro"] == pytest.approx(2 / 3)


def test_macro_f1_skips_experts_never_used_nor_predicted():
    """Pins f1_macro averaging only experts that occur or are predicted (module doc).

    By hand: scores [4, 3, 2, 1], true {0}, k = 1: expert 0 has tp 1 -> F1 1; experts 1..3 have
    2tp + fp + fn = 0 and are skipped, so f1_macro = 1.0 (sklearn with labels range(E) would say
    0.25). Catches M6 (`denom >= 0` counts them as F1 0: 0.25)."""
    res = evaluate_scores(np.array([[[4.0, 3.0, 2.0, 1.0]]]), np.array([[[0]]]), k=1)
    assert res["f1_macro"] == 1.0


def test_extra_k_recall_is_the_mean_over_every_layers_rows():
    """Pins recall_at_{x} (extra_k) as the sum over all (token, layer) rows / all rows.

    By hand: L = 2, E = 4, k = 2, extra_k (1,), one token, scores [4, 3, 2, 1] at both layers, true
    {0, 1} at both: top-1 = {0}, recall@1 = 1 / min(1, 2) = 1 per row, mean 1.0. Catches M8 (dividing
    by one layer's rows: 2 / 1 = 2.0)."""
    acc = MetricAccumulator(2, 4, 2, extra_k=(1,))
    acc.update(np.tile(np.array([4.0, 3.0, 2.0, 1.0]), (1, 2, 1)), np.tile(np.array([0, 1]), (1, 2, 1)))
    assert acc.result()["recall_at_1"] == 1.0


def test_macro_f1_is_the_mean_over_layers_of_each_layers_macro():
    """Pins f1_macro = mean over layers of (mean over that layer's seen experts), not the mean over all
    (layer, expert) pairs.

    By hand: L = 2, E = 4, k = 1, one token, scores [4, 3, 2, 1] at both layers (predicts 0); true
    layer 0 {0}, layer 1 {1}. Layer 0: expert 0 F1 1 -> macro 1. Layer 1: expert 0 fp (F1 0), expert 1
    fn (F1 0) -> macro 0. f1_macro = (1 + 0) / 2 = 0.5. Catches M10 (mean over the pairs {1, 0, 0}:
    1/3)."""
    scores = np.tile(np.array([4.0, 3.0, 2.0, 1.0]), (1, 2, 1))
    res = evaluate_scores(scores, np.array([[[0], [1]]]), k=1)
    assert res["f1_macro"] == 0.5


def test_tied_scores_go_to_the_lower_expert_id():
    """Pins topk_indices' documented tie rule (the lower index wins), which np.argpartition alone does
    not give: for scores [0, 0, 1, 1] and k = 1 it picks expert 3.

    By hand: scores [0, 0, 1, 1]: top-1 = {2} (2 and 3 tie, 2 is lower); top-3 = {2, 3, 0}. With true
    set {2}, recall@1 = 1.0 (argpartition's pick, 3, gives 0.0). A predictor with tied scores (a count
    table) would otherwise be scored on an arbitrary member of the tie."""
    s = np.array([0.0, 0.0, 1.0, 1.0], np.float32)
    assert sorted(topk_indices(s, 1).tolist()) == [2]
    assert sorted(topk_indices(s, 3).tolist()) == [0, 2, 3]
    assert recall_at_k(s[None], np.array([[2]]), k=1) == 1.0
    assert evaluate_scores(s[None, None], np.array([[[2]]]))["recall_at_k"] == 1.0
