"""The slow tiers by name: ``LiveConfig.offload`` accepts exactly these keys.

Adding a tier is one module with a class behind :class:`moecast.runtime.tiers.base.ExpertTier` and one
line here (docs/adding-a-tier.md).
"""

from __future__ import annotations

from moecast.runtime.tiers.base import ExpertTier
from moecast.runtime.tiers.disk import DiskTier
from moecast.runtime.tiers.host import HostTier

TIERS: dict[str, type[ExpertTier]] = {
    HostTier.name: HostTier,
    DiskTier.name: DiskTier,
}


def tier_help() -> str:
    """The registered tiers for a help text, each with its own words: ``ram (host memory) or disk (...)``."""
    named = [f"{name} ({cls.help})" for name, cls in TIERS.items()]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"
