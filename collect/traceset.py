"""TraceSet v1: the on-disk contract between moecast's stages (docs/design.md, "Contracts").

A TraceSet is a directory::

    meta.json                 schema version, model description, collection settings, fields present
    requests/part-*.arrow     one row per request
    tokens/part-*.arrow       one row per token, every MoE layer in one row
    vocab.json                (optional) token text -> id map for ``token_id``; the MoE-Beyond import writes none
                              (its ids are hashes of the token text: meta.collection.token_id_kind)

Every part file is an Arrow IPC stream, the format Hugging Face ``datasets``
memory-maps (``Dataset.from_file``), so a TraceSet streams, shards and maps
like any ``datasets`` dataset without being read into Python objects.

Parts are written atomically: the tokens part first, then the requests part,
each to a temporary name renamed when complete. A requests part is the commit
marker of its chunk: a chunk whose requests part is absent does not exist for
readers and is rewritten on resume, so a kill never leaves a half-written part
that is read as complete.

Per-layer arrays are stored flat (fixed-size lists) and reshaped on read:
``topk_ids`` int16 [L*k], ``topk_weights`` float16 [L*k], ``router_probs``
float16 [L*E], ``gate_inputs`` float16 [L*H].
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from moecast.errors import InputError

if TYPE_CHECKING:
    from moecast.collect.splits import Splits

SCHEMA_VERSION = 1
OPTIONAL_FIELDS = ("topk_weights", "router_probs", "gate_inputs")
#: the shares of requests held out by default (``TraceSet.splits``): every trainer selects on val,
#: ``moecast predictors eval`` and the demo's comparison report test
VAL_FRACTION = 0.1
TEST_FRACTION = 0.1
PHASES = ("prefill", "decode")


class TraceSetError(InputError):
    """A TraceSet is missing, malformed, of another schema, or lacks a needed field."""


class MissingFieldError(TraceSetError):
    """A consumer needs an optional field this TraceSet does not have."""


@dataclass
class ModelInfo:
    """What a TraceSet (and a predictor checkpoint) says about the model it came from."""

    name_or_path: str
    family: str
    moe_layers: list[int]
    num_experts: int
    top_k: int
    num_shared_experts: int
    hidden_size: int
    expert_bytes: int
    norm_topk_prob: bool
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.fingerprint:
            self.fingerprint = model_fingerprint(self.architecture())

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    def architecture(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_shared_experts": self.num_shared_experts,
            "hidden_size": self.hidden_size,
            "expert_bytes": self.expert_bytes,
        }


def model_fingerprint(config: dict[str, Any]) -> str:
    """Stable short hash of a model configuration (keys sorted, JSON-canonical)."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class TraceMeta:
    model: ModelInfo
    collection: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(OPTIONAL_FIELDS, False))
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": asdict(self.model),
            "collection": self.collection,
            "fields": self.fields,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "meta.json") -> TraceMeta:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceSetError(
                f"{where}: TraceSet schema version {version!r}, this moecast reads version {SCHEMA_VERSION}; "
                "re-collect or re-import it with this moecast version"
            )
        try:
            model = ModelInfo(**data["model"])
        except (KeyError, TypeError) as exc:
            raise TraceSetError(
                f"{where}: malformed model section ({exc}); re-collect or re-import it"
            ) from exc
        fields = {name: bool(data.get("fields", {}).get(name, False)) for name in OPTIONAL_FIELDS}
        return cls(model=model, collection=dict(data.get("collection", {})), fields=fields)


# ----------------------------------------------------------------------------- writing


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all: a temporary beside it, synced, renamed over it; a write
    that fails (or is interrupted) leaves ``path`` as it was and removes its temporary."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def _write_table(path: Path, table: pa.Table) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@dataclass
class RequestRecord:
    """Everything recorded for one request, ready to be written into a part."""

    request_id: str
    workload: str
    category: str
    prompt: str
    token_ids: np.ndarray  # [T] int
    token_texts: list[str]
    phases: np.ndarray  # [T] bool, True = decode
    topk_ids: np.ndarray  # [T, L, k]
    topk_weights: np.ndarray | None = None  # [T, L, k]
    router_probs: np.ndarray | None = None  # [T, L, E]
    gate_inputs: np.ndarray | None = None  # [T, L, H]
    reference: str = ""
    output_text: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return int((~self.phases.astype(bool)).sum())

    @property
    def num_generated_tokens(self) -> int:
        return int(self.phases.astype(bool).sum())


def _fixed_list(arr: np.ndarray, dtype: str) -> pa.FixedSizeListArray:
    flat = np.ascontiguousarray(arr.reshape(arr.shape[0], -1).astype(dtype, copy=False))
    width = flat.shape[1]
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), width)


class TraceWriter:
    """Writes a TraceSet part by part; reopening an existing directory resumes it.

    ``done`` holds the request ids already committed, so a re-run skips them.
    Parallel writers (collection shards) use distinct ``shard`` numbers and
    may share one directory; only shard 0 (or ``write_meta``) writes meta.json.
    """

    def __init__(
        self, path: str | Path, meta: TraceMeta, shard: int = 0, overwrite_meta: bool = True
    ) -> None:
        self.path = Path(path)
        self.meta = meta
        self.shard = shard
        (self.path / "requests").mkdir(parents=True, exist_ok=True)
        (self.path / "tokens").mkdir(parents=True, exist_ok=True)
        meta_path = self.path / "meta.json"
        if meta_path.exists():
            self._adopt_existing_meta(meta_path)
        else:
            meta.collection.setdefault("traceset_id", uuid.uuid4().hex[:16])
        if overwrite_meta and (shard == 0 or not meta_path.exists()):
            atomic_write_json(meta_path, meta.to_json())
        # this shard's leftovers only: another shard writing into the same directory may be about
        # to rename its own temporaries
        for stale in list(self.path.glob(f"*/.part-s{shard:03d}-*.tmp-*")):
            stale.unlink(missing_ok=True)
        self.done: set[str] = set()
        self._seq = 0
        self._scan_committed_parts()

    def _adopt_existing_meta(self, meta_path: Path) -> None:
        """Check the directory's meta.json matches this run and carry its TraceSet identity over."""
        meta = self.meta
        try:
            data = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise TraceSetError(
                f"{meta_path}: unreadable JSON ({exc}); fix or delete it, or collect into another --out"
            ) from exc
        existing = TraceMeta.from_json(data, str(meta_path))
        _refuse_other_model(self.path, existing, meta)
        if existing.fields != meta.fields:
            raise TraceSetError(
                f"{self.path} was collected with fields {existing.fields}, this run has {meta.fields}; "
                "use the same options or another --out"
            )
        # the TraceSet keeps its identity as requests are added (checkpoints name it)
        for key in ("traceset_id", "contains_tracesets"):
            meta.collection.pop(key, None)
            if existing.collection.get(key):
                meta.collection[key] = existing.collection[key]

    def _scan_committed_parts(self) -> None:
        """Fill ``done`` from every committed part and move ``_seq`` past this shard's last one."""
        for part in sorted((self.path / "requests").glob("part-*.arrow")):
            ids = _read_table(part).column("request_id").to_pylist()
            self.done.update(ids)
            if part.stem.startswith(f"part-s{self.shard:03d}-"):
                self._seq = max(self._seq, int(part.stem.rsplit("-", 1)[1]) + 1)

    def write(self, records: Sequence[RequestRecord]) -> None:
        if not records:
            return
        tok = self._token_columns(records)
        req = {
            "request_id": pa.array([r.request_id for r in records], pa.string()),
            "workload": pa.array([r.workload for r in records], pa.string()),
            "category": pa.array([r.category for r in records], pa.string()),
            "prompt": pa.array([r.prompt for r in records], pa.string()),
            "num_prompt_tokens": pa.array([r.num_prompt_tokens for r in records], pa.int32()),
            "num_generated_tokens": pa.array([r.num_generated_tokens for r in records], pa.int32()),
            "reference": pa.array([r.reference for r in records], pa.string()),
            "output_text": pa.array([r.output_text for r in records], pa.string()),
        }
        name = f"part-s{self.shard:03d}-{self._seq:05d}.arrow"
        _write_table(self.path / "tokens" / name, pa.table(tok))
        _write_table(self.path / "requests" / name, pa.table(req))  # commit marker: written last
        self._seq += 1
        self.done.update(r.request_id for r in records)

    def _token_columns(self, records: Sequence[RequestRecord]) -> dict[str, pa.Array]:
        """Check each record's shapes and fields and gather the tokens part's columns."""
        L, k = self.meta.model.num_layers, self.meta.model.top_k
        cols: dict[str, list[Any]] = {
            "request_id": [],
            "position": [],
            "phase": [],
            "token_id": [],
            "token_text": [],
        }
        arrays: dict[str, list[np.ndarray]] = {"topk_ids": []}
        for name in OPTIONAL_FIELDS:
            if self.meta.fields.get(name):
                arrays[name] = []
        for rec in records:
            T = len(rec.token_ids)
            if rec.topk_ids.shape != (T, L, k):
                raise TraceSetError(
                    f"request {rec.request_id}: topk_ids shape {rec.topk_ids.shape}, expected {(T, L, k)}"
                )
            cols["request_id"].extend([rec.request_id] * T)
            cols["position"].append(np.arange(T, dtype=np.int32))
            cols["phase"].extend(PHASES[int(p)] for p in rec.phases)
            cols["token_id"].append(np.asarray(rec.token_ids, dtype=np.int32))
            cols["token_text"].extend(rec.token_texts)
            arrays["topk_ids"].append(rec.topk_ids)
            _gather_optional(rec, arrays)
        tok = {
            "request_id": pa.array(cols["request_id"], pa.string()),
            "position": pa.array(np.concatenate(cols["position"])),
            "phase": pa.array(cols["phase"], pa.string()),
            "token_id": pa.array(np.concatenate(cols["token_id"])),
            "token_text": pa.array(cols["token_text"], pa.string()),
            "topk_ids": _fixed_list(np.concatenate(arrays["topk_ids"]), "int16"),
        }
        for name in OPTIONAL_FIELDS:
            if name in arrays:
                tok[name] = _fixed_list(np.concatenate(arrays[name]), "float16")
        return tok


def _gather_optional(rec: RequestRecord, arrays: dict[str, list[np.ndarray]]) -> None:
    """Append ``rec``'s value of each optional field declared present (a key of ``arrays``)."""
    for name in OPTIONAL_FIELDS:
        if name in arrays:
            value = getattr(rec, name)
            if value is None:
                raise TraceSetError(f"request {rec.request_id}: field {name} declared present but missing")
            arrays[name].append(value)


# ----------------------------------------------------------------------------- reading


def _read_table(path: Path) -> pa.Table:
    try:
        with pa.memory_map(str(path), "r") as source:
            return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceSetError(f"{path}: corrupt or truncated part ({exc}); {_redo_part(path.name)}") from exc


def _redo_part(name: str) -> str:
    # a request counts as collected while requests/<part> names it: both files must go
    return (
        f"delete requests/{name} and tokens/{name}, then re-run the collection (or import) with the "
        "same options: it collects the requests of that part again"
    )


@dataclass
class RequestTrace:
    """One request's tokens in order, with zero-copy numpy views of its arrays."""

    request_id: str
    workload: str
    category: str
    prompt: str
    token_ids: np.ndarray
    token_texts: list[str]
    is_decode: np.ndarray
    topk_ids: np.ndarray  # [T, L, k]
    topk_weights: np.ndarray | None
    router_probs: np.ndarray | None
    gate_inputs: np.ndarray | None

    def __len__(self) -> int:
        return len(self.token_ids)

    def prefix(self, n: int) -> RequestTrace:
        """The first ``n`` tokens (views, no copy): what a decoder holds while token n-1 runs."""
        cut = (
            "token_ids",
            "token_texts",
            "is_decode",
            "topk_ids",
            "topk_weights",
            "router_probs",
            "gate_inputs",
        )
        return replace(self, **{f: getattr(self, f)[:n] for f in cut if getattr(self, f) is not None})


class TraceSet:
    """Read access to a TraceSet directory. Open with ``TraceSet(path)``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not self.path.is_dir():
            raise TraceSetError(
                f"{self.path}: no such TraceSet directory; create one with `moecast collect` or `moecast import`"
            )
        if not meta_path.exists():
            raise TraceSetError(
                f"{self.path}: not a TraceSet (no meta.json); point at a directory written by moecast"
            )
        try:
            data = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise TraceSetError(f"{meta_path}: unreadable JSON ({exc}); re-collect or re-import") from exc
        self.meta = TraceMeta.from_json(data, str(meta_path))
        names = sorted(p.name for p in (self.path / "requests").glob("part-*.arrow"))
        missing = [n for n in names if not (self.path / "tokens" / n).exists()]
        if missing:
            raise TraceSetError(f"{self.path}: tokens part {missing[0]} missing; {_redo_part(missing[0])}")
        self._parts = names
        self._req_tables = [_read_table(self.path / "requests" / n) for n in names]
        self._tok_tables = [_read_table(self.path / "tokens" / n) for n in names]
        self._validate()
        # request index: request_id -> (part, start, stop) in that part's token table
        self._index: dict[str, tuple[int, int, int]] = {}
        self._req_rows: dict[str, tuple[int, int]] = {}
        for p, (req, tok) in enumerate(zip(self._req_tables, self._tok_tables)):
            rid = tok.column("request_id").to_numpy(zero_copy_only=False)
            if len(rid) == 0:
                continue
            change = np.flatnonzero(rid[1:] != rid[:-1]) + 1
            starts = np.concatenate([[0], change])
            stops = np.concatenate([change, [len(rid)]])
            for s, e in zip(starts, stops):
                self._index[str(rid[s])] = (p, int(s), int(e))
            for row, r in enumerate(req.column("request_id").to_pylist()):
                if r in self._req_rows:
                    raise TraceSetError(
                        f"{self.path}: request {r} stored twice; merge or re-collect into a new --out"
                    )
                self._req_rows[r] = (p, row)
        self.request_ids: list[str] = [r for r in self._req_rows]
        self._prompt_keys: dict[str, str] | None = None

    # --------------------------------------------------------------- properties
    @property
    def model(self) -> ModelInfo:
        return self.meta.model

    @property
    def num_layers(self) -> int:
        return self.meta.model.num_layers

    @property
    def num_experts(self) -> int:
        return self.meta.model.num_experts

    @property
    def top_k(self) -> int:
        return self.meta.model.top_k

    @property
    def num_tokens(self) -> int:
        return sum(t.num_rows for t in self._tok_tables)

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    def has(self, name: str) -> bool:
        return name in ("topk_ids", "token_id", "token_text") or bool(self.meta.fields.get(name))

    def require(self, name: str, who: str) -> None:
        if not self.has(name):
            raise MissingFieldError(
                f"{who} needs `{name}`, which TraceSet {self.path} does not have "
                f"(fields present: {', '.join(self.fields_present())}); "
                + (
                    "re-collect with --gate-inputs"
                    if name == "gate_inputs"
                    else "collect traces with `moecast collect` (imported traces lack it)"
                )
            )

    def fields_present(self) -> list[str]:
        return ["topk_ids", "token_id", "token_text"] + [
            f for f in OPTIONAL_FIELDS if self.meta.fields.get(f)
        ]

    # --------------------------------------------------------------- validation
    def _validate(self) -> None:
        m = self.meta.model
        widths = {
            "topk_ids": m.num_layers * m.top_k,
            "topk_weights": m.num_layers * m.top_k,
            "router_probs": m.num_layers * m.num_experts,
            "gate_inputs": m.num_layers * m.hidden_size,
        }
        required = ("request_id", "position", "phase", "token_id", "token_text", "topk_ids")
        for name, tok in zip(self._parts, self._tok_tables):
            cols = set(tok.column_names)
            for col in required + tuple(f for f in OPTIONAL_FIELDS if self.meta.fields.get(f)):
                if col not in cols:
                    raise TraceSetError(
                        f"{self.path}/tokens/{name}: column `{col}` missing; the part is corrupt, delete it and re-collect"
                    )
            for col, width in widths.items():
                if col in cols:
                    typ = tok.schema.field(col).type
                    if not pa.types.is_fixed_size_list(typ) or typ.list_size != width:
                        raise TraceSetError(
                            f"{self.path}/tokens/{name}: `{col}` has type {typ}, expected {width} values per token "
                            f"(layers x {'k' if 'topk' in col else 'E or H'}); it belongs to another model or is corrupt"
                        )

    # --------------------------------------------------------------- arrays
    def _width(self, name: str) -> int:
        m = self.meta.model
        return {
            "topk_ids": m.top_k,
            "topk_weights": m.top_k,
            "router_probs": m.num_experts,
            "gate_inputs": m.hidden_size,
        }[name]

    def _part_array(self, p: int, name: str) -> np.ndarray:
        col = self._tok_tables[p].column(name).combine_chunks()
        values = col.values.to_numpy(zero_copy_only=True) if col.offset == 0 else col.flatten().to_numpy()
        return values.reshape(len(col), self.meta.model.num_layers, self._width(name))

    def array(self, name: str, requests: Iterable[str] | None = None) -> np.ndarray:
        """[tokens, layers, k|E|H] numpy array of a per-layer field (rows in request, then token order).

        With one part and no selection the result is a zero-copy view of the
        memory-mapped Arrow data; otherwise the selected rows are gathered.
        """
        if name != "topk_ids":
            self.require(name, f"TraceSet.array({name!r})")
        if requests is None:
            parts = [self._part_array(p, name) for p in range(len(self._parts))]
            if not parts:
                m = self.meta.model
                return np.zeros((0, m.num_layers, m.top_k), dtype=np.int16)
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        chunks = []
        cache: dict[int, np.ndarray] = {}
        for rid in requests:
            p, s, e = self._locate(rid)
            if p not in cache:
                cache[p] = self._part_array(p, name)
            chunks.append(cache[p][s:e])
        return np.concatenate(chunks) if chunks else np.zeros((0, *self._part_array(0, name).shape[1:]))

    def rows(self, name: str, requests: Iterable[str] | None = None) -> FieldRows:
        """A lazy ``array(name, requests)``: the same rows, read from the memory-mapped parts only
        when indexed, so a training run holds one batch of a wide field (gate inputs), not all."""
        if name != "topk_ids":
            self.require(name, f"TraceSet.rows({name!r})")
        ids = self.request_ids if requests is None else list(requests)
        blocks = [self._part_array(p, name) for p in range(len(self._parts))]
        if not ids:
            shape = blocks[0].shape[1:] if blocks else (self.meta.model.num_layers, self._width(name))
            return FieldRows(blocks, np.zeros(0, np.int32), np.zeros(0, np.int64), shape)
        loc = np.array([self._locate(r) for r in ids], dtype=np.int64).reshape(-1, 3)
        lengths = loc[:, 2] - loc[:, 1]
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        offset = np.repeat(loc[:, 1], lengths) + np.arange(int(lengths.sum())) - starts
        return FieldRows(blocks, np.repeat(loc[:, 0], lengths).astype(np.int32), offset, blocks[0].shape[1:])

    def column(self, name: str, requests: Iterable[str] | None = None) -> np.ndarray:
        """A scalar token column (position, token_id, phase, ...) as numpy, same row order as ``array``."""
        if requests is None:
            return (
                np.concatenate([t.column(name).to_numpy(zero_copy_only=False) for t in self._tok_tables])
                if self._tok_tables
                else np.zeros(0)
            )
        out = []
        for rid in requests:
            p, s, e = self._locate(rid)
            out.append(self._tok_tables[p].column(name).slice(s, e - s).to_numpy(zero_copy_only=False))
        return np.concatenate(out) if out else np.zeros(0)

    def _locate(self, rid: str) -> tuple[int, int, int]:
        try:
            return self._index[rid]
        except KeyError:
            raise TraceSetError(f"{self.path}: no request {rid!r}") from None

    def request_lengths(self, requests: Iterable[str] | None = None) -> np.ndarray:
        ids = self.request_ids if requests is None else list(requests)
        return np.array([self._index[r][2] - self._index[r][1] for r in ids], dtype=np.int64)

    def request_info(self, rid: str) -> dict[str, Any]:
        p, row = self._req_rows[rid]
        table = self._req_tables[p]
        return {c: table.column(c)[row].as_py() for c in table.column_names}

    # --------------------------------------------------------------- iteration
    def get(self, rid: str) -> RequestTrace:
        p, s, e = self._locate(rid)
        tok = self._tok_tables[p].slice(s, e - s)
        info = self.request_info(rid)

        def opt(name: str) -> np.ndarray | None:
            return self._part_array(p, name)[s:e] if self.meta.fields.get(name) else None

        return RequestTrace(
            request_id=rid,
            workload=info["workload"],
            category=info["category"],
            prompt=info["prompt"],
            token_ids=tok.column("token_id").to_numpy(),
            token_texts=tok.column("token_text").to_pylist(),
            is_decode=tok.column("phase").to_numpy(zero_copy_only=False) == "decode",
            topk_ids=self._part_array(p, "topk_ids")[s:e],
            topk_weights=opt("topk_weights"),
            router_probs=opt("router_probs"),
            gate_inputs=opt("gate_inputs"),
        )

    def __iter__(self) -> Iterator[RequestTrace]:
        return self.iter_requests()

    def iter_requests(self, requests: Iterable[str] | None = None) -> Iterator[RequestTrace]:
        for rid in self.request_ids if requests is None else requests:
            yield self.get(rid)

    # --------------------------------------------------------------- splits
    @property
    def traceset_id(self) -> str:
        """This TraceSet's identity, kept when requests are added (meta.json ``collection.traceset_id``);
        a TraceSet written before ids existed is known by its resolved path."""
        own = self.meta.collection.get("traceset_id")
        if own:
            return str(own)
        return "path-" + hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]

    def contains_traceset(self, traceset_id: str | None) -> bool:
        """Whether this TraceSet is, or was merged from, the TraceSet of that id (the one a
        checkpoint trained on): its splits then hold that TraceSet's requests on the same sides."""
        inner = self.meta.collection.get("contains_tracesets") or []
        return bool(traceset_id) and (traceset_id == self.traceset_id or traceset_id in inner)

    def prompt_keys(self) -> dict[str, str]:
        """request id -> hash of its normalised prompt text (its prompt token ids where it has none)."""
        if self._prompt_keys is None:
            from moecast.collect.splits import prompt_key

            keys: dict[str, str] = {}
            no_ids = str(self.meta.collection.get("token_id_kind", "")).startswith("absent")
            for table in self._req_tables:
                for rid, text in zip(
                    table.column("request_id").to_pylist(), table.column("prompt").to_pylist()
                ):
                    if (text or "").strip():
                        keys[rid] = prompt_key(text)
                    elif no_ids:
                        keys[rid] = prompt_key("", self.array("topk_ids", [rid]).ravel(), "routes")
                    else:
                        ids = self.column("token_id", [rid])
                        prefill = self.column("phase", [rid]) != "decode"
                        keys[rid] = prompt_key("", ids[prefill] if prefill.any() else ids)
            self._prompt_keys = keys
        return self._prompt_keys

    def splits(
        self, val_fraction: float = VAL_FRACTION, test_fraction: float = TEST_FRACTION, seed: int = 0
    ) -> Splits:
        """Train / val / test by prompt group, seeded and stable as requests are added
        (:mod:`moecast.collect.splits`). Tune and select on val; report test."""
        from moecast.collect.splits import Splits, SplitSpec, assign

        spec = SplitSpec(val_fraction, test_fraction, seed)
        side = assign(self.prompt_keys(), spec)
        by = {name: [r for r in self.request_ids if side[r] == name] for name in ("train", "val", "test")}
        return Splits(spec, by["train"], by["val"], by["test"], self.traceset_id)

    def duplicate_prompts(self) -> dict[str, int]:
        from moecast.collect.splits import duplicate_counts

        return duplicate_counts(self.prompt_keys())

    def split(self, val_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
        """The ungrouped train/validation split of earlier moecast versions, kept only to score
        checkpoints that recorded it; new work uses :meth:`splits`."""
        if not 0.0 <= val_fraction < 1.0:
            raise InputError(f"val_fraction must be in [0, 1), got {val_fraction}")
        return split_request_ids(self.request_ids, val_fraction, seed)

    def datasets(self) -> tuple[Any, Any]:
        """The (requests, tokens) tables as Hugging Face ``datasets.Dataset`` (memory-mapped)."""
        import datasets

        def load(kind: str) -> Any:
            parts = [datasets.Dataset.from_file(str(self.path / kind / n)) for n in self._parts]
            return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]

        if not self._parts:
            raise TraceSetError(f"{self.path}: the TraceSet is empty")
        return load("requests"), load("tokens")

    def vocab(self) -> dict[str, int] | None:
        path = self.path / "vocab.json"
        return json.loads(path.read_text()) if path.exists() else None


def split_request_ids(
    request_ids: Sequence[str], val_fraction: float = VAL_FRACTION, seed: int = 0
) -> tuple[list[str], list[str]]:
    """:meth:`TraceSet.split` of these ids, without opening a TraceSet (e.g. a source's file names)."""
    if val_fraction == 0:
        return list(request_ids), []

    # Hash-based rank keeps the split stable when requests are added or reordered.
    def rank(rid: str) -> str:
        return hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest()

    ordered = sorted(request_ids, key=rank)
    n_val = max(1, round(len(ordered) * val_fraction)) if len(ordered) > 1 else 0
    val = set(ordered[:n_val])
    return [r for r in request_ids if r not in val], [r for r in request_ids if r in val]


def _gather_rows(blocks: Any, part: np.ndarray, offset: np.ndarray, out: np.ndarray) -> None:
    from numba import njit

    global _gather_rows  # compiled on first use: collection never pays numba's import

    @njit(cache=True, nogil=True)
    def gather(blocks: Any, part: np.ndarray, offset: np.ndarray, out: np.ndarray) -> None:
        for i in range(part.shape[0]):
            out[i, :] = blocks[part[i]][offset[i]]

    _gather_rows = gather
    gather(blocks, part, offset, out)


class FieldRows:
    """Rows of one per-layer field over a list of requests, gathered from the TraceSet's memory-mapped
    parts on indexing (``TraceSet.rows``). Holds only the row -> (part, offset) map in memory."""

    def __init__(
        self, blocks: list[np.ndarray], part: np.ndarray, offset: np.ndarray, row_shape: tuple[int, ...]
    ) -> None:
        self.blocks, self.part, self.offset = blocks, part, offset
        self.row_shape = tuple(row_shape)
        self.dtype = blocks[0].dtype if blocks else np.dtype(np.float32)
        self._flat: Any = None

    def __len__(self) -> int:
        return len(self.offset)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.row_shape)

    def __getitem__(self, idx: Any) -> np.ndarray:
        """``idx``: a slice or an integer array of rows -> [n, *row_shape] in the stored dtype."""
        idx = np.arange(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx, dtype=np.int64)
        part, offset = self.part[idx], self.offset[idx]
        if len(self.blocks) == 1:
            return self.blocks[0][offset]
        if self._flat is None:
            from numba import typed

            # the parts' rows as raw bits (one integer type per item size), one list for the kernel
            bits = f"u{self.dtype.itemsize}"
            self._flat = typed.List([b.reshape(len(b), -1).view(bits) for b in self.blocks])
        out = np.empty((len(idx), int(np.prod(self.row_shape))), self._flat[0].dtype)
        _gather_rows(self._flat, part, offset, out)
        return out.view(self.dtype).reshape(len(idx), *self.row_shape)


def open_traces(path: str | Path, *, require_nonempty: bool = True) -> TraceSet:
    ts = TraceSet(path)
    if require_nonempty and ts.num_requests == 0:
        raise TraceSetError(f"{path}: the TraceSet holds no requests; collect or import some first")
    return ts


def merge(sources: Sequence[str | Path], out: str | Path) -> TraceSet:
    """Combine TraceSets of the same model (e.g. collection shards) into ``out``; requests stored once."""
    if not sources:
        raise TraceSetError("merge needs at least one TraceSet")
    sets = [TraceSet(s) for s in sources]
    _check_same_model(sets)
    out = Path(out)
    existing = TraceSet(out) if (out / "meta.json").exists() else None
    if existing is not None:  # checked before anything is written: a refused merge leaves it as it was
        _check_merge_target(out, existing.meta, sets[0].meta)
    meta = _merged_meta(sets, sources, existing)
    (out / "requests").mkdir(parents=True, exist_ok=True)
    (out / "tokens").mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "meta.json", meta.to_json())
    if existing is None:
        existing = TraceSet(out)  # the empty set just written; its parts are what the numbering reads
    _copy_new_parts(sets, out, existing)
    return TraceSet(out)


def _check_same_model(sets: list[TraceSet]) -> None:
    """Refuse sources of another model (fingerprint) or with other fields than the first."""
    first = sets[0].meta
    for ts in sets[1:]:
        if ts.meta.model.fingerprint != first.model.fingerprint:
            raise TraceSetError(
                f"cannot merge {ts.path} (model {ts.meta.model.name_or_path}, fingerprint {ts.meta.model.fingerprint}) "
                f"with {sets[0].path} (model {first.model.name_or_path}, fingerprint {first.model.fingerprint})"
            )
        if ts.meta.fields != first.fields:
            raise TraceSetError(f"cannot merge {ts.path}: fields {ts.meta.fields} differ from {first.fields}")


def _refuse_other_model(path: Path, held: TraceMeta, want: TraceMeta) -> None:
    """Refuse a directory ``path`` whose traces (``held``) are of another model than ``want``'s."""
    if held.model.fingerprint != want.model.fingerprint:
        raise TraceSetError(
            f"{path} holds traces of model {held.model.name_or_path} (fingerprint "
            f"{held.model.fingerprint}), not {want.model.name_or_path} "
            f"(fingerprint {want.model.fingerprint}); choose another --out"
        )


def _check_merge_target(out: Path, held: TraceMeta, first: TraceMeta) -> None:
    """Refuse an existing ``out`` that holds another model's traces or other fields than the sources."""
    _refuse_other_model(out, held, first)
    if held.fields != first.fields:
        raise TraceSetError(
            f"{out} holds fields {held.fields}, the sources {first.fields}; choose another --out"
        )


def _merged_meta(sets: list[TraceSet], sources: Sequence[str | Path], existing: TraceSet | None) -> TraceMeta:
    """The merged set's meta.json: the first source's, with every source's workloads and provenance."""
    first = sets[0].meta
    metas = [ts.meta for ts in sets] + ([existing.meta] if existing is not None else [])
    meta = TraceMeta(model=first.model, collection=dict(first.collection), fields=dict(first.fields))
    # every source's workloads stay named (collection settings of the first source otherwise)
    meta.collection["workloads"] = list(
        dict.fromkeys(w for m in metas for w in m.collection.get("workloads", []))
    )
    meta.collection["categories"] = {
        k: v for m in metas for k, v in (m.collection.get("categories") or {}).items()
    }
    gens = {str(ts.path): ts.meta.collection.get("generation") for ts in sets}
    if len({json.dumps(g, sort_keys=True) for g in gens.values()}) > 1:
        meta.collection["generation_by_source"] = gens
    meta.collection["merged_from"] = [str(s) for s in sources]
    # the sources' requests keep their sides (splits hash prompts), so a checkpoint trained on a
    # source is scored on the merged set's split, not on all of it
    meta.collection["traceset_id"] = existing.traceset_id if existing is not None else uuid.uuid4().hex[:16]
    meta.collection["contains_tracesets"] = sorted(
        {i for ts in sets for i in [ts.traceset_id, *(ts.meta.collection.get("contains_tracesets") or [])]}
        | set((existing.meta.collection.get("contains_tracesets") or []) if existing is not None else [])
    )
    meta.collection["merged_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return meta


def _copy_new_parts(sets: list[TraceSet], out: Path, existing: TraceSet) -> None:
    """Append the sources' requests that ``out`` does not hold yet as new parts (and a vocab.json)."""
    seen: set[str] = set(existing.request_ids)
    # after the highest existing number, not the count: a deleted part leaves a gap in the numbering
    taken = [
        int(n[len("part-s000-") : -len(".arrow")]) for n in existing._parts if n.startswith("part-s000-")
    ]
    seq = max(taken, default=-1) + 1
    from tqdm import tqdm

    bar = tqdm(total=sum(len(ts._parts) for ts in sets), desc="merge", unit="part", leave=False)
    for ts in sets:
        if (ts.path / "vocab.json").exists() and not (out / "vocab.json").exists():
            atomic_write_bytes(out / "vocab.json", (ts.path / "vocab.json").read_bytes())
        for p, _name in enumerate(ts._parts):
            bar.update()
            tables = _unseen_rows(ts, p, seen)
            if tables is None:
                continue
            req, tok = tables
            new = f"part-s000-{seq:05d}.arrow"
            _write_table(out / "tokens" / new, tok)
            _write_table(out / "requests" / new, req)
            seq += 1
            seen.update(req.column("request_id").to_pylist())
    bar.close()


def _unseen_rows(ts: TraceSet, p: int, seen: set[str]) -> tuple[pa.Table, pa.Table] | None:
    """Part ``p``'s (requests, tokens) tables cut to the requests not in ``seen``; None when none is new."""
    req, tok = ts._req_tables[p], ts._tok_tables[p]
    ids = req.column("request_id").to_pylist()
    keep = [r not in seen for r in ids]
    if not any(keep):
        return None
    if not all(keep):
        keep_ids = pa.array([r for r, k in zip(ids, keep) if k])
        import pyarrow.compute as pc

        req = req.filter(pc.is_in(req.column("request_id"), keep_ids))
        tok = tok.filter(pc.is_in(tok.column("request_id"), keep_ids))
    return req, tok
