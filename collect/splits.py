"""Request splits of a TraceSet: train / val / test, grouped by prompt (DESIGN.md, "Contracts").

- Requests with the same prompt form one group and always fall on the same side: the key is a
  hash of the normalised prompt text (Unicode NFKC, case-folded, whitespace collapsed), or of
  the prompt's token ids where a request has no text (its routes where the ids were not recorded
  either: MoE-Beyond's prediction CSVs). A held-out copy of a training prompt
  would otherwise be scored from memory (19 of 200 held-out DeepSeek Puffin prompts were).
- A group's side depends only on the hash of (seed, key): u in [0, 1) puts it in test when
  u < test_fraction, in val when u < test_fraction + val_fraction, else in train. Adding
  requests never moves an existing one. Only on sets too small for a side to receive any group
  by chance is the lowest-u group moved into an empty side, so that tiny sets still train.
- Tune and select on val, report test; another TraceSet is scored whole.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass
from typing import Any

from moecast.errors import InputError

METHOD = "prompt-groups-v1"
SPLIT_NAMES = ("train", "val", "test")


def normalise_prompt(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def prompt_key(text: str, token_ids: Any = (), kind: str = "ids") -> str:
    """The group key of one request: its normalised prompt text, else its prompt token ids (``kind``
    routes: its routes, for imports that record neither text nor ids)."""
    norm = normalise_prompt(text or "")
    blob = ("text:" + norm) if norm else (f"{kind}:" + ",".join(str(int(t)) for t in token_ids))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _unit(seed: int, key: str) -> float:
    return int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:13], 16) / 16**13


@dataclass(frozen=True)
class SplitSpec:
    """How a TraceSet's requests are split; recorded in every checkpoint trained on a split."""

    val_fraction: float = 0.1
    test_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("val_fraction", "test_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < 1):
                raise InputError(f"{name} must be a number in [0, 1), not {v!r}")
        if self.val_fraction + self.test_fraction >= 1:
            raise InputError(
                f"val_fraction {self.val_fraction} + test_fraction {self.test_fraction} leave no "
                "training requests; keep their sum below 1"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InputError(f"the split seed must be an integer, not {self.seed!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "method": METHOD,
            "val_fraction": self.val_fraction,
            "test_fraction": self.test_fraction,
            "seed": self.seed,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> SplitSpec | None:
        """The spec a checkpoint recorded; None for a split of an earlier moecast (ungrouped, no test)."""
        if not data or data.get("method") != METHOD:
            return None
        return cls(float(data["val_fraction"]), float(data["test_fraction"]), int(data["seed"]))


@dataclass
class Splits:
    """The three sides of one TraceSet under one spec, each in the TraceSet's request order."""

    spec: SplitSpec
    train: list[str]
    val: list[str]
    test: list[str]
    traceset_id: str

    def __getitem__(self, name: str) -> list[str]:
        if name == "all":
            return [*self.train, *self.val, *self.test]
        if name not in SPLIT_NAMES:
            raise InputError(f"no split {name!r}; choose train, val, test or all")
        return list(getattr(self, name))

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint records: the spec, the TraceSet's id and the sides' sizes."""
        return {
            **self.spec.to_json(),
            "traceset_id": self.traceset_id,
            "train_requests": len(self.train),
            "val_requests": len(self.val),
            "test_requests": len(self.test),
        }


def assign(keys: dict[str, str], spec: SplitSpec) -> dict[str, str]:
    """request id -> side, from request id -> group key (see the module docstring)."""
    groups = sorted(set(keys.values()), key=lambda g: (_unit(spec.seed, g), g))
    u = {g: _unit(spec.seed, g) for g in groups}
    side = {
        g: "test"
        if u[g] < spec.test_fraction
        else "val"
        if u[g] < spec.test_fraction + spec.val_fraction
        else "train"
        for g in groups
    }
    # a side asked for but empty (few groups): the lowest-u training group moves there
    for name, frac in (("test", spec.test_fraction), ("val", spec.val_fraction)):
        train = [g for g in groups if side[g] == "train"]
        if frac > 0 and name not in side.values() and len(train) > 1:
            side[train[0]] = name
    return {rid: side[g] for rid, g in keys.items()}


def duplicate_counts(keys: dict[str, str]) -> dict[str, int]:
    """How many requests share their prompt with another request, and in how many groups."""
    sizes: dict[str, int] = {}
    for g in keys.values():
        sizes[g] = sizes.get(g, 0) + 1
    return {
        "duplicate_requests": sum(n for n in sizes.values() if n > 1),
        "duplicate_groups": sum(1 for n in sizes.values() if n > 1),
        "largest_group": max(sizes.values(), default=0),
        "distinct_prompts": len(sizes),
    }
