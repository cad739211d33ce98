"""One Lightning run of a gradient-trained predictor: loggers, checkpoints, early stopping, resume, export.

The fit functions (``fit_llapor``, ``fit_sequence``, ``fit_eap``) build their module and data
module from typed settings and hand them to :func:`fit`. A module exports itself with
``export(out, datamodule, info) -> Path`` and logs ``val/recall``, the monitored value.

The run directory defaults to ``<out without suffix>.run/`` beside ``out`` (never inside the
checkout unless ``out`` is); it holds the wandb (offline) and CSV logs, the best and last
Lightning checkpoints and ``config.yaml``, the settings of the run. ``resume="auto"``
continues from its ``last.ckpt`` when present, ``"never"`` starts afresh, a path resumes from
that Lightning checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from moecast.train.config import TrainConfig

from moecast.errors import InputError

MONITOR = "val/recall"


def run_dir_for(out: str | Path, run_dir: str | None = None) -> Path:
    out = Path(out)
    return Path(run_dir) if run_dir else out.with_name(out.name.removesuffix(".safetensors") + ".run")


def resume_path(resume: str, run_dir: Path) -> str | None:
    if resume == "never":
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / "last.ckpt"
        return str(last) if last.is_file() else None
    if not Path(resume).is_file():
        raise FileNotFoundError(
            f"resume {resume}: no such Lightning checkpoint; use auto, never or a .ckpt path"
        )
    return resume


def _loggers(train: TrainConfig, run_dir: Path, out: Path, group: str) -> Any:
    if not train.logger:
        return False
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    offline = os.environ.get("WANDB_MODE", "offline") != "online"
    wandb = WandbLogger(project="moecast", group=group, name=out.stem, save_dir=str(run_dir), offline=offline)
    return [wandb, CSVLogger(save_dir=str(run_dir), name="csv")]


def _callbacks(train: TrainConfig, run_dir: Path) -> list[Any]:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    ckpts = str(run_dir / "checkpoints")
    best = ModelCheckpoint(dirpath=ckpts, filename="best", monitor=MONITOR, mode="max", save_top_k=1)
    # last.ckpt after every epoch, for resume. Not the best callback's save_last: Lightning writes
    # that only in an epoch that also wrote a best checkpoint, so a resumed run would repeat every
    # epoch since the best one
    last = ModelCheckpoint(
        dirpath=ckpts, filename="last", monitor=None, save_top_k=1, enable_version_counter=False
    )
    stop = EarlyStopping(monitor=MONITOR, mode="max", patience=train.patience)
    return [stop, best, last]


def trainer_for(train: TrainConfig, run_dir: Path, out: Path, group: str) -> Any:
    """The Lightning Trainer of ``train``'s settings, logging and checkpointing under ``run_dir``."""
    import lightning.pytorch as pl

    return pl.Trainer(
        max_epochs=train.max_epochs,
        max_time=train.max_time,
        accelerator=train.accelerator,
        devices=train.devices,
        strategy=train.strategy,
        precision=train.precision,
        gradient_clip_val=train.gradient_clip_val,
        log_every_n_steps=train.log_every_n_steps,
        enable_progress_bar=train.progress_bar,
        enable_model_summary=train.model_summary,
        fast_dev_run=train.fast_dev_run,
        logger=_loggers(train, run_dir, out, group),
        callbacks=_callbacks(train, run_dir),
        default_root_dir=str(run_dir),
    )


def _discard_failed_run(new_run_dir: bool, run_dir: Path) -> None:
    """A run that failed before writing any checkpoint (bad data, a setting the traces cannot
    serve) leaves nothing to resume: close its wandb run and remove the run directory it created,
    so the error is the last thing printed and no empty run waits to be synced."""
    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].finish(exit_code=1)
    if new_run_dir and not any((run_dir / "checkpoints").glob("*.ckpt")):
        shutil.rmtree(run_dir, ignore_errors=True)


def _write_settings(run_dir: Path, settings: dict[str, Any]) -> None:
    import yaml
    from moecast.collect.traceset import atomic_write_bytes

    plain = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in settings.items()}
    atomic_write_bytes(run_dir / "config.yaml", yaml.safe_dump(plain, sort_keys=False).encode())


def _load_best(trainer: Any, module: Any) -> str:
    """Load the best validation epoch's weights (and its metrics) into ``module``; its path."""
    import torch

    cb = trainer.checkpoint_callback
    best = cb.best_model_path if cb is not None else ""
    if best and Path(best).is_file():
        ckpt = torch.load(best, map_location="cpu", weights_only=False)
        module.load_state_dict(ckpt["state_dict"])
        if ckpt.get("moecast_val") is not None:  # that epoch's metrics, not the last epoch's
            module.last_val = ckpt["moecast_val"]
    return best


def fit(
    module: Any,
    datamodule: Any,
    out: str | Path,
    train: TrainConfig,
    run_dir: str | None = None,
    resume: str = "auto",
    settings: dict[str, Any] | None = None,
    json: bool = False,
) -> Path:
    """Train ``module`` on ``datamodule`` under ``train``, export the best epoch to ``out``; the path.

    ``settings`` (the fit function's arguments) go to ``<run_dir>/config.yaml``; with ``--config``
    that file trains the same run again. ``json``: the closing line as one JSON object.
    """
    import lightning.pytorch as pl

    out = Path(out)
    if not out.name.endswith(".safetensors"):
        raise InputError(f"out {out}: name the predictor checkpoint *.safetensors")
    rd = run_dir_for(out, run_dir)
    ckpt_path = resume_path(resume, rd)
    new_run_dir = not rd.exists()
    rd.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(train.seed, workers=True, verbose=False)
    trainer = trainer_for(train, rd, out, f"{Path(str(datamodule.traces)).name}-{type(module).__name__}")
    if trainer.is_global_zero and settings is not None:
        _write_settings(rd, settings)
    if ckpt_path:
        print(f"resuming from {ckpt_path}")
    started = time.perf_counter()
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except Exception:  # an interrupted run keeps its logs
        _discard_failed_run(new_run_dir, rd)
        raise
    info = _run_info(trainer, module, rd, ckpt_path, started)
    if not trainer.is_global_zero:
        return out  # under DDP every rank runs this; rank 0 writes the file
    path = module.export(out, datamodule, info)
    if "wandb" in sys.modules:
        # close this run so a later fit in the same process starts its own
        sys.modules["wandb"].finish()
    if json:
        from moecast.jsonout import dumps

        print(dumps(dict(checkpoint=str(path), monitor=MONITOR, best=info["best_score"], run_dir=str(rd),
                         epochs=info["epochs"], resumed_from=ckpt_path)))  # fmt: skip
    else:
        print(f"wrote {path} (best {MONITOR} = {info['best_score']}); run dir {rd}")
    return path


def _run_info(trainer: Any, module: Any, rd: Path, ckpt_path: str | None, started: float) -> dict[str, Any]:
    """What the export records of the run, after loading the best epoch's weights into ``module``."""
    import torch

    info = {
        "best_score": None,
        "best_ckpt": _load_best(trainer, module),
        "run_dir": str(rd),
        "epochs": int(trainer.current_epoch),
        "train_seconds": round(time.perf_counter() - started, 1),
        "resumed_from": ckpt_path,
        "torch_threads": torch.get_num_threads(),
    }
    cb = trainer.checkpoint_callback
    if cb is not None and cb.best_model_score is not None:
        info["best_score"] = float(cb.best_model_score)
    return info
