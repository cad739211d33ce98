"""Import MoE-Beyond's CSV routing traces (github.com/ngavhane/moe-beyond, ``training_data_eamc``).

One file per prompt, ``prompt_<N>_data.csv``, columns ``Layer ID, Batch Number, Token,
Activated Expert IDs``; rows grouped by layer, token order within a layer, so the
i-th row of layer L is token position i. The traces are one prefill pass of
DeepSeek-V2-Lite-Chat: the TraceSet gets ``topk_ids``, ``token_text`` and
``phase=prefill`` only, and meta.json says that weights, router probabilities
and gate inputs are absent.

Token ids: the DeepSeek tokenizer is not available offline, so ``token_id`` is a
stable 31-bit hash of the token text (``meta.collection.token_id_kind``), the same
for a token in every import, whichever files are chosen. The prompt text is
rebuilt from the byte-level BPE token texts.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
from moecast.collect.traceset import ModelInfo, RequestRecord, TraceMeta, TraceSet, TraceSetError, TraceWriter

from moecast import __version__
from moecast.errors import InputError

COLUMNS = ["Layer ID", "Batch Number", "Token", "Activated Expert IDs"]
# MoE-Beyond's published predictions (test_datasets/predicted_csvs): Token is the position
PREDICTED_COLUMNS = ["Layer ID", "Token", "Activated Expert IDs", "Predicted Expert IDs"]
FILE_RE = re.compile(r"prompt_(\d+)_")
BOS = "<｜begin▁of▁sentence｜>"

# DeepSeek-V2-Lite (config.json of deepseek-ai/DeepSeek-V2-Lite-Chat): 27 layers, layer 0 dense,
# 64 routed experts of intermediate size 1408, top-6, 2 shared experts, hidden 2048.
DEEPSEEK_V2_LITE = dict(
    name_or_path="deepseek-ai/DeepSeek-V2-Lite-Chat",
    family="deepseek_v2",
    num_experts=64,
    top_k=6,
    num_shared_experts=2,
    hidden_size=2048,
    # gate, up and down projections of one routed expert in bf16, the dtype a runtime moves
    expert_bytes=3 * 2048 * 1408 * 2,
    norm_topk_prob=False,
)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode map used by byte-level BPE tokenizers (DeepSeek's included)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def detokenize(tokens: list[str]) -> str:
    """Rebuild text from byte-level BPE token strings; special tokens are dropped."""
    dec = _byte_decoder()
    out = bytearray()
    for tok in tokens:
        if tok.startswith("<｜") and tok.endswith("｜>"):
            continue
        for ch in tok:
            b = dec.get(ch)
            if b is None:
                out.extend(ch.encode())
            else:
                out.append(b)
    return out.decode("utf-8", errors="replace")


def token_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def prompt_number(path: Path) -> int | None:
    """The prompt number in a file name (``prompt_<N>_...``, else the last number in it)."""
    m = FILE_RE.search(path.name) or re.search(r"(\d+)(?!.*\d)", path.stem)
    return int(m.group(1)) if m else None


def csv_header(path: Path) -> list[str] | None:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            return next(csv.reader(fh), None)
    except (OSError, UnicodeDecodeError, csv.Error):
        return None


def list_files(source: Path, header: list[str] | None = None) -> list[tuple[int, Path]]:
    """(prompt number, path) of every CSV in ``source`` with a MoE-Beyond header (``header``: that
    one only), ordered by prompt number: the training CSVs (``prompt_<N>_data.csv``), the test
    set's (``prompt_<N>_data_formatted.csv``) or the published predictions (``predicted_csvs``)."""
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: not a directory of MoE-Beyond CSV traces (prompt_<N>_data.csv)")
    wanted = [header] if header else [COLUMNS, PREDICTED_COLUMNS]
    files: dict[int, Path] = {}
    for p in sorted(source.glob("*.csv")):
        if csv_header(p) not in wanted:
            continue
        n = prompt_number(p)
        if n is None:
            raise InputError(f"{p}: no prompt number in the file name; name it prompt_<N>_....csv")
        if n in files:
            raise InputError(
                f"{files[n].name} and {p.name} are both prompt {n}; keep one of them in {source}"
            )
        files[n] = p
    if not files:
        raise FileNotFoundError(
            f"{source}: no CSV with MoE-Beyond's header ({', '.join(wanted[0])}); point at its "
            "training_data_eamc folder, test_datasets/formatted_csvs or test_datasets/predicted_csvs"
        )
    return sorted(files.items())


def parse_file(
    path: Path, num_experts: int = 64, top_k: int | None = None
) -> tuple[list[int], list[str], np.ndarray]:
    """(layer ids, token texts, topk_ids [T, L, k] int16) of one CSV; InputError on any malformation.

    A predictions CSV (``Predicted Expert IDs`` column) lists token positions, not texts: its
    token texts come back empty and its routing is the ``Activated Expert IDs`` column."""
    layers, tokens, ids = _read(path, num_experts, top_k)
    return layers, tokens, ids["Activated Expert IDs"]


def parse_predicted(path: Path, num_experts: int = 64) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(layer ids, activated [T, L, k], predicted [T, L, k]) of one MoE-Beyond predictions CSV."""
    if csv_header(path) != PREDICTED_COLUMNS:
        raise InputError(f"{path}: expected MoE-Beyond's prediction columns {PREDICTED_COLUMNS}")
    layers, _, ids = _read(path, num_experts, None)
    return layers, ids["Activated Expert IDs"], ids["Predicted Expert IDs"]


def _read(
    path: Path, num_experts: int, top_k: int | None
) -> tuple[list[int], list[str], dict[str, np.ndarray]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason}); is it a MoE-Beyond CSV?") from None
    if "\x00" in text:
        raise InputError(f"{path}: contains NUL bytes; the file is corrupt, restore it from the source")
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:
        raise InputError(f"{path}: malformed CSV ({exc})") from None
    header = rows[0] if rows else None
    if header not in (COLUMNS, PREDICTED_COLUMNS):
        raise InputError(f"{path}: expected columns {COLUMNS} (or {PREDICTED_COLUMNS}), got {header}")
    id_cols = [i for i, c in enumerate(header) if c.endswith("Expert IDs")]
    text_col = 2 if header == COLUMNS else None
    layers, tokens, chunks, counts = _rows(path, rows[1:], len(header), id_cols, text_col)
    T = counts[layers[0]]
    ragged = {L: c for L, c in counts.items() if c != T}
    if ragged:
        raise InputError(
            f"{path}: ragged layers: layer {layers[0]} has {T} tokens but {ragged} (truncated CSV?)"
        )
    out = {
        header[c]: _ids(path, chunks[j], len(layers), T, num_experts, top_k) for j, c in enumerate(id_cols)
    }
    return layers, tokens if text_col is not None else [""] * T, out


def _rows(
    path: Path, rows: list[list[str]], width: int, id_cols: list[int], text_col: int | None
) -> tuple[list[int], list[str], list[list[str]], dict[int, int]]:
    """Layers in order, the first layer's token texts, each id column's list bodies, rows per layer."""
    layers: list[int] = []
    tokens: list[str] = []
    chunks: list[list[str]] = [[] for _ in id_cols]
    counts: dict[int, int] = {}
    for lineno, row in enumerate(rows, start=2):
        if len(row) != width:
            raise InputError(
                f"{path}:{lineno}: expected {width} fields, got {len(row)} (truncated or malformed CSV)"
            )
        try:
            layer = int(row[0])
        except ValueError:
            raise InputError(f"{path}:{lineno}: layer id {row[0]!r} is not an integer") from None
        # a layer's rows come together, layers in rising order, so a row's layer is never below the
        # last one begun (interleaved rows read as grouped would give tokens each other's routes)
        if layers and layer < layers[-1]:
            raise InputError(f"{path}:{lineno}: rows of layer {layer} are not grouped together")
        if layer not in counts:
            counts[layer] = 0
            layers.append(layer)
        if layer == layers[0] and text_col is not None:
            tokens.append(row[text_col])
        counts[layer] += 1
        for j, c in enumerate(id_cols):
            ids = row[c].strip()
            if not (ids.startswith("[") and ids.endswith("]")):
                raise InputError(f"{path}:{lineno}: expert ids {ids!r} are not a [..] list")
            chunks[j].append(ids[1:-1])
    if not counts:
        raise InputError(f"{path}: no rows")
    return layers, tokens, chunks, counts


def _ids(path: Path, chunks: list[str], L: int, T: int, num_experts: int, top_k: int | None) -> np.ndarray:
    """[T, L, k] int16 from one column's list bodies (rows grouped by layer, token order within)."""
    try:
        flat = np.array([int(x) for chunk in chunks for x in chunk.split(",")], dtype=np.int64)
    except ValueError as exc:
        raise InputError(f"{path}: non-integer expert id ({exc})") from None
    k = top_k or len(chunks[0].split(","))
    if flat.size != len(chunks) * k:
        raise InputError(f"{path}: every row must list exactly {k} expert ids")
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise InputError(
            f"{path}: expert id {int(flat.max() if flat.max() >= num_experts else flat.min())} outside 0..{num_experts - 1}"
        )
    ids = flat.reshape(L, T, k).transpose(1, 0, 2)
    if (np.sort(ids, -1)[..., 1:] == np.sort(ids, -1)[..., :-1]).any():
        raise InputError(f"{path}: a row lists the same expert twice")
    return ids.astype(np.int16)


def _parse_job(args: tuple[int, Path, int]) -> tuple[int, list[int], list[str], np.ndarray]:
    n, path, num_experts = args
    layers, tokens, ids = parse_file(path, num_experts)
    return n, layers, tokens, ids


def _records(
    jobs: list[tuple[int, Path, int]], workers: int
) -> Iterator[tuple[int, list[int], list[str], np.ndarray]]:
    if workers <= 1 or len(jobs) < 8:
        yield from map(_parse_job, jobs)
        return
    with ProcessPoolExecutor(workers) as pool:
        yield from pool.map(_parse_job, jobs, chunksize=16)


def import_moe_beyond(
    source: Path,
    *,
    out: Path,
    max_files: int | None = None,
    chunk: int = 200,
    workers: int = 2,
    model: str = DEEPSEEK_V2_LITE["name_or_path"],
    workload: str | None = None,
    json: bool = False,
) -> TraceSet:
    """Import MoE-Beyond CSV routing traces (DeepSeek-V2-Lite) into a TraceSet.

    Any CSV with MoE-Beyond's header is read, in prompt-number order: the training traces
    (``prompt_<N>_data.csv``), its test set (``test_datasets/formatted_csvs``) and its published
    predictions (``test_datasets/predicted_csvs``, whose Activated Expert IDs become the routing;
    they list token positions, not texts). Score those predictions with
    ``moecast predictors eval moe-beyond:DIR --traces OUT``.

    Args:
        source: folder of MoE-Beyond CSVs (e.g. ../shared/traces/deepseek-v2-lite-puffin).
        out: TraceSet directory to write; re-running resumes, skipping prompts already imported.
        max_files: import only the first N prompts (by prompt number).
        chunk: prompts per Arrow part (each part is written atomically).
        workers: parsing processes.
        model: model name recorded in meta.json.
        workload: workload name and request id prefix (<workload>-<N>); default puffin for the
            training CSVs (prompt_<N>_data.csv), moe-beyond-test for the others.
        json: print one JSON object instead of a line.
    """
    source, out = Path(source), Path(out)
    files, workload, predicted = _select_files(source, max_files, workload)
    _n0, p0 = files[0]
    layers, _, first = parse_file(p0, DEEPSEEK_V2_LITE["num_experts"])
    info = ModelInfo(
        moe_layers=layers, **{**DEEPSEEK_V2_LITE, "name_or_path": model, "top_k": first.shape[2]}
    )
    writer = TraceWriter(out, _import_meta(source, info, workload, predicted))
    todo = [(n, p, info.num_experts) for n, p in files if f"{workload}-{n}" not in writer.done]
    _write_records(writer, todo, len(files), layers, workload, chunk, workers)
    ts = TraceSet(out)
    had = len(files) - len(todo)  # a resumed import: these were in ``out`` already
    if json:
        from moecast.jsonout import dumps

        print(dumps(dict(out=str(out), imported=len(todo), already=had, prompts=ts.num_requests,
                         tokens=ts.num_tokens, layers=ts.num_layers)))  # fmt: skip
        return ts
    print(
        f"imported {len(todo)} prompts"
        + (f" ({had} already there)" if had else "")
        + f"; {out} holds {ts.num_requests} prompts, {ts.num_tokens} tokens x {ts.num_layers} MoE layers"
    )
    return ts


def _select_files(
    source: Path, max_files: int | None, workload: str | None
) -> tuple[list[tuple[int, Path]], str, bool]:
    """(the (prompt number, path) files to import, the workload name, whether they are predictions)."""
    files = list_files(source)
    training_layout = all(p.name == f"prompt_{n}_data.csv" for n, p in files)
    workload = workload or ("puffin" if training_layout else "moe-beyond-test")
    predicted = csv_header(files[0][1]) == PREDICTED_COLUMNS
    if any((csv_header(p) == PREDICTED_COLUMNS) != predicted for _, p in files):
        raise InputError(
            f"{source} mixes traces and prediction CSVs; import test_datasets/formatted_csvs and "
            "predicted_csvs into two TraceSets"
        )
    if max_files is not None:
        if max_files <= 0:
            raise InputError("--max-files must be positive")
        files = files[:max_files]
    return files, workload, predicted


def _import_meta(source: Path, info: ModelInfo, workload: str, predicted: bool) -> TraceMeta:
    """The imported TraceSet's meta.json: prefill-only top-k ids, no weights, probabilities or gate inputs."""
    return TraceMeta(
        model=info,
        collection={
            "source": "moe-beyond import",
            "source_path": str(source),
            # one identity per source folder: an import of the same files elsewhere is the same set
            "traceset_id": "mb-" + hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16],
            "workloads": [workload],
            "generation": {"phase": "prefill only", "max_new_tokens": 0},
            "dtype": "int8 (bitsandbytes, as recorded by MoE-Beyond)",
            "token_id_kind": "absent (the predictions CSVs list token positions, not texts)"
            if predicted
            else "sha1-31bit hash of the token text (DeepSeek tokenizer not available offline)",
            "absent": ["topk_weights", "router_probs", "gate_inputs"],
            "tool_version": __version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        fields={"topk_weights": False, "router_probs": False, "gate_inputs": False},
    )


def _write_records(
    writer: TraceWriter,
    todo: list[tuple[int, Path, int]],
    total: int,
    layers: list[int],
    workload: str,
    chunk: int,
    workers: int,
) -> None:
    """Parse the files still to import and write them, ``chunk`` prompts per part, with a progress bar."""
    from tqdm.auto import tqdm

    batch: list[RequestRecord] = []
    with tqdm(total=total, initial=total - len(todo), desc="import moe-beyond", unit="prompt") as bar:
        for n, file_layers, tokens, ids in _records(todo, workers):
            if file_layers != layers:
                raise TraceSetError(
                    f"prompt {n} has MoE layers {file_layers[:3]}..., expected {layers[:3]}..."
                )
            batch.append(_request(workload, n, tokens, ids))
            bar.update()
            if len(batch) >= chunk:
                writer.write(batch)
                batch = []
        writer.write(batch)


def _request(workload: str, n: int, tokens: list[str], ids: np.ndarray) -> RequestRecord:
    """Prompt ``n``'s RequestRecord: prefill tokens with hashed ids and the rebuilt prompt text."""
    text = detokenize(tokens)
    return RequestRecord(
        request_id=f"{workload}-{n}",
        workload=workload,
        category="chat",
        prompt=text,
        token_ids=np.array([token_hash(t) for t in tokens], dtype=np.int32),
        token_texts=tokens,
        phases=np.zeros(len(tokens), dtype=bool),
        topk_ids=ids,
    )
