"""moecast: record where an MoE model's router sends tokens, learn to predict it, keep the right experts resident.

The stages live in ``moecast.collect``, ``moecast.predictors``, ``moecast.train`` and
``moecast.runtime``; this package only wires them into the ``moecast`` command.
"""

__version__ = "0.1.0"

from pathlib import Path


def configs_dir() -> Path:
    """The shipped YAML configs: ``moecast/configs`` in an installed wheel, ``configs/`` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs", here.parent / "configs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"moecast's configs/ folder was not found beside {here}; reinstall moecast")


def home() -> Path:
    """Cache directory for built models and downloads: $MOECAST_HOME, default ~/.cache/moecast."""
    import os

    return Path(os.environ.get("MOECAST_HOME", Path.home() / ".cache" / "moecast")).expanduser()
