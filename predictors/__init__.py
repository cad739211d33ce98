"""moecast.predictors: expert-activation predictors, their safetensors checkpoints, and baselines."""

from moecast.predictors.base import HORIZONS, Predictor, topk_from_scores
from moecast.predictors.checkpoint import CheckpointError
from moecast.predictors.registry import load, register

__all__ = ["HORIZONS", "CheckpointError", "Predictor", "load", "register", "topk_from_scores"]
