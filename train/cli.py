"""``moecast train NAME --config X.yaml --traces PATH --out CKPT.safetensors``: LightningCLI runs.

``TRAINERS`` maps each ``moecast train`` subcommand to a lazily imported
``"module:target"``; only the chosen one is imported. A target is one of:

1. a ``LightningModule`` subclass with
   - a class attribute ``datamodule_class``: a ``LightningDataModule`` whose
     ``__init__`` takes ``traces: str`` first (linked from ``--traces``) plus
     its own typed hyper-parameters (all settable in YAML under ``data:``);
   - a method ``export(self, out: Path, datamodule, info: dict) -> Path`` that
     writes the trained predictor with ``moecast.predictors.checkpoint.save``
     (``info`` holds ``best_score``, ``best_ckpt``, ``run_dir``, ``epochs``).
   The run then gets LightningCLI options (``--model.*``, ``--data.*``,
   ``--trainer.*``, ``--early_stopping.*``, ``--config``), WandbLogger +
   CSVLogger under the run directory, a best/last ``ModelCheckpoint``
   monitoring ``val/recall`` (the module must log it), early stopping, and
   resume from ``RUN_DIR/checkpoints/last.ckpt``.
2. a plain function ``f(argv: list[str]) -> Any`` for builds that are not
   gradient training (e.g. an index); it parses its own arguments.

To add a trainer, add one line below, e.g.
``"eap": "moecast.train.eap:EAPModule"`` (a LightningModule, case 1) or
``"eam": "moecast.train.eam:build_eam"`` (a function, case 2), then
``moecast train eap --config configs/eap_tiny.yaml --traces ... --out ...``.

The run directory defaults to ``<out without suffix>.run/`` beside ``--out``
(never inside the checkout unless ``--out`` is); ``--resume auto`` (default)
continues from its ``last.ckpt`` when present, ``--resume never`` starts
afresh, ``--resume PATH`` resumes from that Lightning checkpoint.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path
from typing import Any

from moecast.errors import InputError

TRAINERS: dict[str, str] = {
    "llapor": "moecast.train.llapor:LLaPorModule",
    "sequence": "moecast.train.sequence:SequenceModule",
    "eap": "moecast.train.eap:EAPModule",
    "eam": "moecast.train.eam:build_eam",
    "cascade": "moecast.train.cascade:build_cascade",
}

MONITOR = "val/recall"


def _usage() -> str:
    names = "|".join(TRAINERS)
    return (
        f"usage: moecast train {names} --config CONFIG.yaml --traces TRACES --out CKPT.safetensors "
        "[--resume auto|never|PATH] [--run_dir DIR] [--model.X ...] [--data.X ...] [--trainer.X ...]"
    )


def _resolve(name: str) -> Any:
    if name not in TRAINERS:
        raise InputError(f"unknown trainer {name!r}; choose one of {', '.join(TRAINERS)} ({_usage()})")
    module, attr = TRAINERS[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise InputError(f"trainer {name!r} is not available in this installation ({exc})") from exc
    return getattr(mod, attr)


def _dashes_to_underscores(argv: list[str]) -> list[str]:
    # Users type --run-dir / --max-epochs; jsonargparse option names use underscores.
    out = []
    for arg in argv:
        if arg.startswith("--") and not arg.startswith("--config"):
            name, eq, value = arg.partition("=")
            arg = name[:2] + name[2:].replace("-", "_") + eq + value
        out.append(arg)
    return out


def run_dir_for(out: str | Path, run_dir: str | None = None) -> Path:
    out = Path(out)
    return Path(run_dir) if run_dir else out.with_name(out.name.removesuffix(".safetensors") + ".run")


def _make_cli_class() -> type:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    class MoecastCLI(LightningCLI):
        """LightningCLI with moecast's run-level options, loggers, checkpointing and resume."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--traces", type=str, required=True, help="TraceSet directory to train on")
            parser.add_argument(
                "--out", type=str, required=True, help="where to write the predictor .safetensors"
            )
            parser.add_argument(
                "--run_dir", type=str | None, default=None, help="Lightning/wandb run directory"
            )
            parser.add_argument("--resume", type=str, default="auto", help="auto | never | PATH to a .ckpt")
            parser.link_arguments("traces", "data.traces")
            parser.add_lightning_class_args(EarlyStopping, "early_stopping")
            parser.set_defaults(
                {
                    "early_stopping.monitor": MONITOR,
                    "early_stopping.mode": "max",
                    "early_stopping.patience": 5,
                }
            )

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            cfg = self.config_init
            run_dir = run_dir_for(cfg["out"], cfg["run_dir"])
            self.new_run_dir = not run_dir.exists()  # a run that fails before any checkpoint leaves none
            run_dir.mkdir(parents=True, exist_ok=True)
            traces = Path(cfg["traces"]).name
            predictor = type(self.model).__name__
            offline = os.environ.get("WANDB_MODE", "offline") != "online"
            base = self._get(self.config_init, "trainer", default={}) or {}
            loggers: Any = base.get("logger")
            if loggers is None or loggers is True:  # not set by the user: wandb (offline) and CSV
                loggers = [
                    WandbLogger(
                        project="moecast",
                        group=f"{traces}-{predictor}",
                        name=Path(cfg["out"]).stem,
                        save_dir=str(run_dir),
                        offline=offline,
                    ),
                    CSVLogger(save_dir=str(run_dir), name="csv"),
                ]
            best = ModelCheckpoint(
                dirpath=str(run_dir / "checkpoints"),
                filename="best",
                monitor=MONITOR,
                mode="max",
                save_top_k=1,
            )
            # last.ckpt after every epoch, for --resume. Not the best callback's save_last: Lightning
            # writes that only in an epoch that also wrote a best checkpoint, so a resumed run would
            # repeat every epoch since the best one
            last = ModelCheckpoint(
                dirpath=str(run_dir / "checkpoints"),
                filename="last",
                monitor=None,
                save_top_k=1,
                enable_version_counter=False,
            )
            callbacks = [*(base.get("callbacks") or []), best, last]
            if not base.get("default_root_dir"):
                kwargs.setdefault("default_root_dir", str(run_dir))
            return super().instantiate_trainer(logger=loggers, callbacks=callbacks, **kwargs)

    return MoecastCLI


def _resume_path(resume: str, run_dir: Path) -> str | None:
    if resume == "never":
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / "last.ckpt"
        return str(last) if last.is_file() else None
    if not Path(resume).is_file():
        raise FileNotFoundError(
            f"--resume {resume}: no such Lightning checkpoint; use auto, never or a .ckpt path"
        )
    return resume


def _discard_failed_run(cli: Any, run_dir: Path) -> None:
    """A run that failed before writing any checkpoint (bad data, a setting the traces cannot
    serve) leaves nothing to resume: close its wandb run and remove the run directory it created,
    so the error is the last thing printed and no empty run waits to be synced."""
    import shutil
    import sys

    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].finish(exit_code=1)
    if getattr(cli, "new_run_dir", False) and not any((run_dir / "checkpoints").glob("*.ckpt")):
        shutil.rmtree(run_dir, ignore_errors=True)


def train(argv: list[str]) -> Path | Any:
    """Train a predictor (``moecast train NAME ...``); returns the exported checkpoint path."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        print("\ntrainers: " + ", ".join(f"{k} ({v})" for k, v in TRAINERS.items()))
        return None
    name, rest = argv[0], _dashes_to_underscores(list(argv[1:]))
    target = _resolve(name)
    if not (inspect.isclass(target) and hasattr(target, "datamodule_class")):
        return target(rest)

    import torch
    from lightning.pytorch import LightningModule

    if not issubclass(target, LightningModule):
        raise ValueError(f"trainer {name!r} ({TRAINERS[name]}) is neither a LightningModule nor a function")
    if "--help" not in rest and "-h" not in rest:
        for opt in ("--traces", "--out"):
            if not any(a == opt or a.startswith(opt + "=") for a in rest):
                raise InputError(f"moecast train {name} needs {opt}; {_usage()}")
    import warnings

    # we pass argv explicitly (moecast's own argv differs from LightningCLI's); that is intended
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    from jsonargparse import ArgumentError

    try:
        cli = _make_cli_class()(
            target,
            target.datamodule_class,
            args=rest,
            run=False,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            # raise instead of printing the whole usage, so the error is one line like moecast's others
            parser_kwargs={"prog": f"moecast train {name}", "exit_on_error": False},
        )
    except ArgumentError as exc:
        detail = " ".join(str(exc).split())
        raise InputError(f"{detail} (see `moecast train {name} --help`)") from None
    cfg = cli.config_init
    out = Path(cfg["out"])
    run_dir = run_dir_for(out, cfg["run_dir"])
    ckpt_path = _resume_path(cfg["resume"], run_dir)
    if ckpt_path:
        print(f"resuming from {ckpt_path}")
    import time

    started = time.perf_counter()
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    except Exception:  # an interrupted run keeps its logs
        _discard_failed_run(cli, run_dir)
        raise
    train_seconds = time.perf_counter() - started
    ckpt_cb = cli.trainer.checkpoint_callback
    best = ckpt_cb.best_model_path if ckpt_cb is not None else ""
    if best and Path(best).is_file():
        # Export the best validation epoch, not the last one.
        ckpt = torch.load(best, map_location="cpu", weights_only=False)
        cli.model.load_state_dict(ckpt["state_dict"])
        if ckpt.get("moecast_val") is not None:  # that epoch's metrics, not the last epoch's
            cli.model.last_val = ckpt["moecast_val"]
    score = ckpt_cb.best_model_score if ckpt_cb is not None else None
    info = {
        "best_score": float(score) if score is not None else None,
        "best_ckpt": best,
        "run_dir": str(run_dir),
        "epochs": int(cli.trainer.current_epoch),
        "train_seconds": round(train_seconds, 1),
        "resumed_from": ckpt_path,
        "torch_threads": torch.get_num_threads(),
    }
    if not cli.trainer.is_global_zero:
        return out  # under DDP every rank runs this; rank 0 writes the file
    path = cli.model.export(out, cli.datamodule, info)
    import sys

    if "wandb" in sys.modules:
        # close this run so a later `train` in the same process starts its own
        sys.modules["wandb"].finish()
    print(f"wrote {path} (best {MONITOR} = {info['best_score']}); run dir {run_dir}")
    return path
