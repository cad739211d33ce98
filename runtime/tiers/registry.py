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
