"""Typed settings of a training run: the groups ``moecast train NAME`` takes (``--train.*``, ``--data.*``).

Each trainer is one typed function (``fit_llapor``, ``fit_sequence``, ``fit_eap``,
``fit_eam``, ``fit_cascade``) whose grouped arguments are frozen dataclasses; jsonargparse
turns them into ``--group.field`` options and ``--config`` YAML sections, and Python callers
(the demo, benches, tests) pass the same dataclasses. A setting has one default, the
dataclass field's; a trainer's recipe (its epochs, say) is the default of its own argument.
Values are checked when a dataclass is built, so a bad one fails before any data is read.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moecast.collect.traceset import TEST_FRACTION, VAL_FRACTION

from moecast.errors import InputError


def check_range(
    section: str,
    name: str,
    value: Any,
    kind: type = float,
    lo: float | None = None,
    hi: float | None = None,
    open_lo: bool = False,
    open_hi: bool = False,
    optional: bool = False,
) -> None:
    """One clear :class:`InputError` when a setting has the wrong type or lies outside its range."""
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and math.isfinite(value) and (kind is float or float(value).is_integer())
    if ok and lo is not None:
        ok = value > lo if open_lo else value >= lo
    if ok and hi is not None:
        ok = value < hi if open_hi else value <= hi
    if not ok:
        rng = ""
        if lo is not None or hi is not None:
            left = ("(" if open_lo else "[") + (f"{lo:g}" if lo is not None else "-inf")
            right = (f"{hi:g}" if hi is not None else "inf") + (")" if open_hi else "]")
            rng = f" in {left}, {right}"
        raise InputError(
            f"{section}.{name} must be {'an integer' if kind is int else 'a number'}{rng}, got {value!r}"
        )


def check_flag(section: str, name: str, value: Any, also: tuple[str, ...] = ()) -> None:
    if not isinstance(value, bool) and value not in also:
        allowed = " or ".join(["true", "false", *(repr(a) for a in also)])
        raise InputError(f"{section}.{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SplitConfig:
    """Which requests a trainer learns from and which it holds out (``TraceSet.splits``: train / val /
    test, by prompt group). A trainer fits on train and selects on val; test is never trained or
    selected on (``moecast predictors eval`` reports it).

    Args:
        val_fraction: share of requests held out for validation: selects the best epoch
        test_fraction: share of requests held out for testing
        seed: split seed
        max_requests: use at most this many requests (all when null)
    """

    val_fraction: float = VAL_FRACTION
    test_fraction: float = TEST_FRACTION
    seed: int = 0
    max_requests: int | None = None

    def __post_init__(self) -> None:
        # an empty validation split has nothing to select the best epoch by
        check_range("data", "val_fraction", self.val_fraction, float, 0, 1, open_lo=True, open_hi=True)
        check_range("data", "test_fraction", self.test_fraction, float, 0, 1, open_hi=True)
        check_range(
            "data", "seed", self.seed, int, 0, 2**32 - 1
        )  # numpy and sklearn take seeds in this range
        check_range("data", "max_requests", self.max_requests, int, 1, optional=True)
        if self.val_fraction + self.test_fraction >= 1:
            raise InputError(
                f"data.val_fraction + data.test_fraction = {self.val_fraction + self.test_fraction:g} leaves "
                "no training requests; keep the sum below 1"
            )


@dataclass(frozen=True)
class TrainConfig:
    """How a gradient-trained predictor trains (Lightning's Trainer, early stopping on val/recall).

    Args:
        max_epochs: epochs at most (the learning-rate schedules are laid out over them)
        patience: epochs without a better val/recall before stopping early
        max_time: wall-time limit as DD:HH:MM:SS (null: none)
        accelerator: cpu, gpu or auto
        devices: devices (processes under ddp) or auto
        strategy: auto or ddp (one process per device)
        precision: Lightning precision, e.g. bf16-mixed (null: 32-bit)
        gradient_clip_val: clip gradients to this norm (null: no clipping)
        log_every_n_steps: training-loss logging interval
        progress_bar: show the progress bar
        model_summary: print the model summary
        logger: log to wandb (offline unless WANDB_MODE=online) and CSV under the run directory
        fast_dev_run: run one batch of training and validation, as a smoke test
        seed: seed of every random generator (weights, shuffling, dropout)
    """

    max_epochs: int = 10
    patience: int = 5
    max_time: str | None = None
    accelerator: str = "auto"
    devices: int | str = "auto"
    strategy: str = "auto"
    precision: str | None = None
    gradient_clip_val: float | None = None
    log_every_n_steps: int = 50
    progress_bar: bool = True
    model_summary: bool = True
    logger: bool = True
    fast_dev_run: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        # the warm-up and cosine schedules are laid out over max_epochs: a run bounded only by
        # time or steps would squeeze them into its first epoch
        check_range("train", "max_epochs", self.max_epochs, int, 1)
        check_range("train", "patience", self.patience, int, 1)
        check_range("train", "log_every_n_steps", self.log_every_n_steps, int, 1)
        check_range(
            "train", "gradient_clip_val", self.gradient_clip_val, float, 0, open_lo=True, optional=True
        )
        check_range("train", "seed", self.seed, int, 0, 2**32 - 1)


def config_args(fit: Callable[..., Any], path: str | Path) -> dict[str, Any]:
    """The arguments a ``--config`` YAML file gives ``fit``: each section of a grouped argument as
    its dataclass (the fields it leaves out keep ``fit``'s default), the other keys as they are.
    What the demo and benches pass to the fit functions."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise InputError(f"{path} is not valid YAML ({exc}); fix the file") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: a config is a mapping of settings, got {type(raw).__name__}")
    params = inspect.signature(fit).parameters
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in params:
            raise InputError(f"{path}: unknown setting {key!r}; known: {', '.join(params)}")
        default = params[key].default
        if dataclasses.is_dataclass(default):
            # a section sets some fields of the function's own default, as on the command line
            try:
                value = dataclasses.replace(default, **(value or {}))
            except TypeError as exc:
                raise InputError(f"{path}: section {key}: {exc}") from None
        out[key] = value
    return out
