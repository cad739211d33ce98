"""Workload specs: parsing, local datasets in each dataset's real column format, references and scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from moecast.collect.fixtures import write_fixtures
from moecast.collect.workloads import (
    CATEGORIES,
    WorkloadError,
    WorkloadSpec,
    available,
    get_spec,
    iter_rows,
    load_requests,
    parse_workloads,
)

BUILT_IN = ["boolq", "gaokao", "gsm8k", "race-middle", "sharegpt", "triviaqa", "wic"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_fixtures(tmp_path_factory.mktemp("data"), rows=10)


def test_built_in_specs_parse():
    assert available() == BUILT_IN
    for name in BUILT_IN:
        spec = get_spec(name)
        assert spec.name == name and spec.category in CATEGORIES and spec.template
    assert {get_spec(n).category for n in BUILT_IN} >= {"exam", "language", "knowledge", "reasoning", "chat"}


@pytest.mark.parametrize("name", [n for n in BUILT_IN if n != "sharegpt"])
def test_local_fixture_references_follow_the_rows(name, data):
    rows = [json.loads(line) for line in (data / f"{name}.jsonl").read_text().splitlines()]
    reqs = load_requests(get_spec(name), data, limit=5)
    assert [r.request_id for r in reqs] == [f"{name}-{i:06d}" for i in range(5)]
    for row, req in zip(rows, reqs):
        expected = {
            "gsm8k": lambda r: r["answer"].rsplit("####", 1)[1].strip(),
            "boolq": lambda r: "yes" if r["answer"] else "no",
            "race-middle": lambda r: r["answer"],
            "wic": lambda r: "yes" if r["label"] else "no",
            "triviaqa": lambda r: r["answer"]["value"],
            "gaokao": lambda r: r["answer"],
        }[name](row)
        assert req.reference == expected
        # the prompt carries the row's question text
        key = {"wic": "sentence1", "race-middle": "article"}.get(name, "question")
        assert row[key] in req.prompt
    if name == "race-middle":
        assert "A. " in reqs[0].prompt and "D. " in reqs[0].prompt


def test_scoring_extracts_the_answer():
    gsm = get_spec("gsm8k")
    assert gsm.correct("5 boxes of 8 is 40, minus 19 is 21", "21") is True
    assert gsm.correct("the answer is 22", "21") is False
    assert get_spec("boolq").correct(" Yes, it is.", "yes") is True
    assert get_spec("race-middle").correct(" B) because", "B") is True
    assert get_spec("triviaqa").correct(" Paris.\nQ: next", "Paris") is True
    assert get_spec("sharegpt").correct("anything", "") is None


def test_local_formats_directory_parquet_and_subsets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"q{i}", "passage": "p", "answer": bool(i % 2)} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "boolq.parquet")
    assert [r.reference for r in load_requests(get_spec("boolq"), tmp_path)] == ["no", "yes", "no", "yes"]
    # a folder per dataset, files per split: the spec's split is chosen
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [{"question": "train q", "answer": "#### 1"}])
    _jsonl(folder / "test.jsonl", [{"question": "test q", "answer": "x\n#### 2"}])
    reqs = load_requests(get_spec("gsm8k"), tmp_path)
    assert len(reqs) == 1 and reqs[0].reference == "2" and "test q" in reqs[0].prompt
    # gaokao subjects as files in a folder (GAOKAO-Bench's {"example": [...]} wrapper)
    gk = tmp_path / "gaokao"
    gk.mkdir()
    for subject in ("math", "history"):
        (gk / f"{subject}.json").write_text(
            json.dumps({"example": [{"question": f"{subject} q", "answer": ["C"]}]})
        )
    rows = list(iter_rows(get_spec("gaokao"), tmp_path))
    assert sorted(r["subset"] for r in rows) == ["history", "math"]
    assert {r.reference for r in load_requests(get_spec("gaokao"), tmp_path)} == {"C"}


def test_save_to_disk_folder(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"word": "bank", "sentence1": "a", "sentence2": "b", "label": 1}])
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "wic"))
    (req,) = load_requests(get_spec("wic"), tmp_path)
    assert req.reference == "yes" and "'bank'" in req.prompt


def test_errors_name_the_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WorkloadError, match=r"mandarjoshi/trivia_qa.*--data-dir"):
        load_requests(get_spec("triviaqa"), tmp_path)
    with pytest.raises(WorkloadError, match="local-only"):
        load_requests(get_spec("gaokao"), None)
    (tmp_path / "gsm8k.jsonl").write_text("")
    with pytest.raises(WorkloadError, match="no usable rows"):
        load_requests(get_spec("gsm8k"), tmp_path)
    (tmp_path / "boolq.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(WorkloadError, match="passage"):
        load_requests(get_spec("boolq"), tmp_path)
    (tmp_path / "wic.jsonl").write_text("{not json\n")
    with pytest.raises(WorkloadError, match=r"wic\.jsonl:1"):
        load_requests(get_spec("wic"), tmp_path)
    with pytest.raises(WorkloadError, match="unknown workload"):
        parse_workloads(["gsm8k", "nope"])
    with pytest.raises(WorkloadError, match="empty"):
        parse_workloads("")
    with pytest.raises(WorkloadError, match="twice"):
        parse_workloads(["wic", "wic"])
    with pytest.raises(WorkloadError, match="at least 1"):
        load_requests(get_spec("wic"), tmp_path, limit=0)


def test_custom_spec_yaml(tmp_path, data):
    spec_path = tmp_path / "capitals.yaml"
    spec_path.write_text(
        "name: triviaqa\ncategory: knowledge\ntemplate: 'Capital? {question}'\nanswer_field: answer.aliases\n"
        "answer_regex: \"'([^']+)'\"\nmetric: exact_match\n"
    )
    (spec,) = parse_workloads(str(spec_path))
    req = load_requests(spec, data, limit=1)[0]
    assert req.prompt.startswith("Capital? ") and req.reference and "'" not in req.reference
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncategory: chat\ntemplate: '{q}'\ntemplte: typo\n")
    with pytest.raises(WorkloadError, match=r"unknown key.*templte"):
        WorkloadSpec.from_yaml(bad)
    bad.write_text("name: x\ncategory: sports\ntemplate: '{q}'\n")
    with pytest.raises(WorkloadError, match="category"):
        WorkloadSpec.from_yaml(bad)


def test_sharegpt_first_human_turns():
    reqs = load_requests(get_spec("sharegpt"), None, limit=4)
    assert len(reqs) == 4 and len({r.request_id for r in reqs}) == 4
    assert all(r.workload == "sharegpt" and r.category == "chat" and r.prompt.strip() for r in reqs)
    assert all(len(r.prompt) <= get_spec("sharegpt").max_prompt_chars for r in reqs)
    # same ids on every run (resume and sharding depend on it)
    assert [r.request_id for r in load_requests(get_spec("sharegpt"), None, limit=4)] == [
        r.request_id for r in reqs
    ]
