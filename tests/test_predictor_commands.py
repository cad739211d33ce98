"""`moecast predictors eval` (predictors/commands.py): what it prints and reports, and the arguments it
refuses in one line."""

from __future__ import annotations

import pytest
from moecast.predictors.commands import evaluate, format_table

from moecast.errors import InputError


def test_eval_table_puts_each_metric_under_its_header_and_names_the_moe_layers():
    """Every figure under its own column, the extra recalls on the "also" line (not recall@k again),
    and the per-layer recalls labelled by the model's MoE layer numbers (3 and 5), not positions."""
    res = {"predictor": "frequency", "horizon": "statistical", "traces": "T", "split": "test", "requests": 2,
           "tokens": 24, "online_lr": 0.0, "split_notes": ["in-sample"], "k": 2, "recall_at_k": 0.5,
           "precision": 0.25, "f1_micro": 0.125, "f1_macro": 0.0625, "recall_at_1": 0.75,
           "per_group": {"input": {"recall_at_k": 0.4, "precision": 0.3, "f1_micro": 0.2, "f1_macro": 0.1}},
           "per_layer": {"recall_at_k": [0.1, 0.2]}}  # fmt: skip
    lines = format_table(res, [3, 5]).splitlines()
    assert lines[:2] == ["frequency (statistical) on T [test: 2 requests, 24 tokens]", "note: in-sample"]
    head = lines[2].split()
    assert dict(zip(head, lines[3].split())) == {
        "scope": "all", "recall@2": "0.5000", "precision": "0.2500", "f1_micro": "0.1250", "f1_macro": "0.0625",
    }  # fmt: skip
    assert dict(zip(head, lines[4].split()[1:])) == {
        "scope": "input", "recall@2": "0.4000", "precision": "0.3000", "f1_micro": "0.2000", "f1_macro": "0.1000",
    }  # fmt: skip
    assert lines[5] == "also: recall@1 0.7500 (recall@x: share of the predicted x inside the true top-2)"
    assert lines[6] == "per layer recall@k: 3:0.100 5:0.200"


def test_eval_scores_at_most_max_requests_of_each_checkpoint_and_reports_recalls_below_top_k(
    synthetic_traces, capsys
):
    """Top-2 traces: recall@1 is the only extra recall (recall@2 is recall@k itself); --max-requests 2
    scores 2 of the 6 requests, for every checkpoint named, and the report says 2."""
    outs = evaluate(
        ["frequency", "cooccurrence"], str(synthetic_traces), split="all", max_requests=2, json=True
    )
    assert [o["requests"] for o in outs] == [2, 2]
    assert all({k for k in o if k.startswith("recall_at_")} == {"recall_at_k", "recall_at_1"} for o in outs)


def test_eval_refuses_a_kind_that_is_trained_not_fitted_by_name(synthetic_traces):
    """llapor is a registered kind with no fit(ts, train_ids): refused in one line naming the kinds
    eval builds, not an AttributeError from a fit it lacks."""
    with pytest.raises(InputError, match="llapor: no such checkpoint file, and not a baseline name") as exc:
        evaluate("llapor", str(synthetic_traces), split="all")
    assert "\n" not in str(exc.value)
