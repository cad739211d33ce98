"""What the live runtime does: :class:`LiveConfig`, its vocabularies, and :func:`live_config`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from moecast.runtime.core import eviction
from moecast.runtime.core.policy import POLICIES, Policy, with_policies
from moecast.runtime.core.spec import RuntimeSpec
from moecast.runtime.tiers.base import DEVICE_OPS, ExpertTier
from moecast.runtime.tiers.precision import TwoCopies, expert_setting
from moecast.runtime.tiers.registry import TIERS

from moecast.errors import InputError


def _live_eviction(name: str) -> bool:
    """Whether a live run can evict by ``name``: not by the next use (belady's), which only a replay knows."""
    return "nu" not in eviction.get(name).reads


def live_policies() -> tuple[str, ...]:
    """The ``policy`` names a live run takes: the presets of runtime/core/policy.py (those registered so
    far) but those that evict by the future accesses (belady: replay only)."""
    return tuple(n for n, p in POLICIES.items() if _live_eviction(p.eviction))


#: the presets a live run takes, as at import (:func:`live_policies` reads them now)
LIVE_POLICIES = live_policies()
PREFETCH_SOURCES = ("auto", "none", "online", "predictor")
#: balance overrides the policy's balancer; ``load`` loads every miss (the policy vocabulary's ``none``)
BALANCE = ("smoe", "presched", "load", "cpu")
#: where experts that are not resident live: the tiers of runtime/tiers/registry.py (host RAM, an offload
#: directory read with direct I/O)
OFFLOAD = tuple(TIERS)


@dataclass
class LiveConfig(RuntimeSpec):
    """What the runtime does (:func:`attach` takes it whole or field by field).

    Attributes:
        policy: A preset of runtime/core/policy.py (the replay's, but belady): <POLICY_HELP>; or a
            :class:`~moecast.runtime.core.policy.Policy`. Here presched starts from the initial placement (the
            runtime has no hot-expert table of its own) and static's fixed slots hold a predictor's
            hot-expert table, else experts 0..c-1.
        capacity: Experts per layer on the device: a fraction of E (0.25), a count (6), bytes ("512MB");
            None: all of them (full residency).
        alpha: SMoE substitution threshold in [0, 1); 0 leaves the routing untouched; None: the policy's
            default (0.3 under smoe). Only ``smoe`` substitutes (the replay's rule), so alpha > 0 with
            another policy is refused.
        hardware: Hardware profile name (configs/hardware), YAML path or HardwareProfile for the modeled times;
            None: this machine's profile where ``moecast profile`` wrote one (``local``), else the replay's
            default, prescope-a100-pcie4 (``stats()["hardware"]`` and ``hardware_from`` say which).
        prefetch: Where prefetch candidates come from: auto (if the policy prefetches: the predictor if
            given, else online), none, online (next gate on this gate input), predictor.
        balance: Overrides the policy's balancer for decode misses: smoe (SMoE Algorithm 2), presched
            (PreScope's PreSched, Algorithm 1: the load/CPU split with the predicted next layer in the link
            queue, and the prefetch count), load (always load), cpu (always CPU); None: the policy's.
        warm: Fill the slots at attach (SMoE §4.1); False starts every layer empty.
        score_window: SMoE Eq. 3's n (steps averaged by the score policy).
        device: Where slots live (default: where the experts are; a CUDA device for the real path).
        device_ops: How copies reach the slots: ``auto`` (CUDA's streams and events where the slots are on
            a CUDA device, else synchronous copies on the CPU) or ``simulated`` (the CPU walks the CUDA
            path: copies queued on a simulated transfer stream with one event each, the compute stream
            waiting for them, a link at the hardware profile's rate; :mod:`moecast.runtime.tiers.simulated`).
        online_update: After each decoded token, one continual-learning step of the layer-ahead predictor
            on its now-known routing (PreScope §4.2.2); off by default.
        online_lr: Learning rate of those steps.
        learn_plans: CasMoE's buffer: each prompt given to ``rt.plan`` goes, with the EP of its prefill's
            routing (Eq. 3), to the planner's buffer, which folds C of them into the EAM's index (and
            rewrites a saved EAM's files); needs an EAM or cascade planner. Off by default.
        pinned_mb: Host memory (MB) the expert copies may pin on CUDA (default: half the available
            memory); above it they stay pageable and transfers go through a few pinned staging buffers.
        offload: Where the experts that are not resident live, a tier of runtime/tiers/registry.py: ``ram``
            (host memory) or ``disk`` (``offload_dir``, read with direct I/O; :mod:`moecast.runtime.tiers.disk`). Under ``disk`` a
            model whose experts are in memory has them written to ``offload_dir`` once (resumable) and
            dropped from memory until ``detach``, which reads them back.
        offload_dir: The offload directory for ``offload="disk"``.
        io_threads: Threads reading the offload directory. The experts computed on the CPU are read in
            waves of max(2, io_threads), two waves at a time, so their buffers stay at
            2 x max(2, io_threads) experts however many a long prefill computes.
        predictor_ms: The predictor's latency per layer (ms) charged before a prefetch may start, as in
            the replay; None: a figure the checkpoint's header carries, else the hardware profile's
            (``moecast profile --predictor CKPT`` times it on this machine).
        expert_dtype: The precision of the experts the slow tier holds and the slots compute
            (:mod:`moecast.runtime.tiers.precision`): ``model`` (the model's dtype, exact), ``int8`` (per
            output channel) or ``int4`` (group-wise). The link moves its bytes and a capacity in bytes counts
            them. On the CPU it needs ``offload="disk"`` (the offload directory holds its copy beside the
            model-dtype one) and the slots compute on the packed weights; on an accelerator (CUDA, or
            ``device_ops="simulated"``) either tier holds it (``ram``: quantized once at attach) and a
            load's packed block is dequantized into its slot on the device, which computes at the
            model's dtype. Two copies
            (:mod:`moecast.runtime.core.mixed`): ``mixed`` (``model+int4``), ``int8+int4``,
            ``model+int8``, ``int8+int4-g64``, high first: both live in the offload directory (needs
            ``offload="disk"``), a slot holds either and is sized for the high one; demand misses and
            the CPU set read the low copy, the window's prefetches the low one and, with the time it
            leaves, the high one for the most confident, and idle link time rereads the high copy over
            resident low ones (upgrades), as the replay models it.
        group_size: int4's group along the input dimension (32, 64, 128 or 256); a matrix whose input
            dimension it does not divide is quantized per output channel instead.
        graphs: On an accelerator, replay each layer's decode experts call (one token) as a graph
            captured at its first call (:mod:`moecast.runtime.live.graphs`: a CUDA graph, or the
            simulated device's stand-in), so the host launches one graph instead of the implementation's
            kernels one by one; a call that cannot be captured runs as it is. False: never capture.
    """

    capacity: float | int | str | None = None
    prefetch: str = "auto"
    balance: str | None = None
    warm: bool = True
    device: str | None = None
    device_ops: str = "auto"
    online_update: bool = False
    online_lr: float = 1e-4
    learn_plans: bool = False
    pinned_mb: float | None = None
    offload: str = "ram"
    offload_dir: str | None = None
    io_threads: int = 2
    graphs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy) and self.policy not in POLICIES:
            names = live_policies()  # read now: a policy registered after import is one of them
            raise InputError(f"unknown policy {self.policy!r}; choose one of {', '.join(names)}")
        rule = self.policy if isinstance(self.policy, Policy) else POLICIES[self.policy]
        if not _live_eviction(rule.eviction):
            raise InputError(
                f"policy {rule.name!r} evicts by the future accesses ({rule.eviction} reads the next use): "
                f"it is a replay bound (moecast replay --policy {rule.name})"
            )
        # replay's rule, so that one policy name means the same in both runtimes: only policies that
        # substitute (smoe) take an alpha in [0, 1), 0.3 when none is given
        self.alpha = super().rule().alpha
        if self.prefetch not in PREFETCH_SOURCES:
            raise InputError(
                f"unknown prefetch {self.prefetch!r}; choose one of {', '.join(PREFETCH_SOURCES)}"
            )
        if self.balance is not None and self.balance not in BALANCE:
            raise InputError(f"unknown balance {self.balance!r}; choose one of {', '.join(BALANCE)}")
        if self.offload not in TIERS:
            raise InputError(f"unknown offload {self.offload!r}; choose one of {', '.join(TIERS)}")
        if self.device_ops not in DEVICE_OPS:
            raise InputError(f"unknown device_ops {self.device_ops!r}; choose one of {', '.join(DEVICE_OPS)}")
        if int(self.io_threads) < 1:
            raise InputError(f"io_threads must be at least 1, got {self.io_threads}")
        if self.pinned_mb is not None and not (math.isfinite(self.pinned_mb) and self.pinned_mb >= 0):
            raise InputError(f"pinned_mb must be a size in MB >= 0, got {self.pinned_mb}")
        self.precision = expert_setting(self.expert_dtype, int(self.group_size))
        if isinstance(self.precision, TwoCopies) and not getattr(self.tier, "holds_copies", False):
            raise InputError(
                f"expert_dtype={self.expert_dtype} keeps two copies of each expert, which only an offload "
                "directory holds: use offload='disk' and offload_dir=DIR"
            )
        # each tier refuses what it cannot hold (the disk tier needs its directory; only it holds a quantized copy)
        self.tier.check(self)

    def rule(self) -> Policy:
        """The spec's policy with ``balance`` overriding its balancer (``load``: the vocabulary's ``none``)."""
        rule = super().rule()
        if self.balance is None:
            return rule
        return dataclasses.replace(rule, balancer="none" if self.balance == "load" else self.balance)

    @property
    def tier(self) -> type[ExpertTier]:
        """The slow tier ``offload`` names."""
        return TIERS[self.offload]


LiveConfig.__doc__ = with_policies(LiveConfig.__doc__ or "", exclude=("belady",))


def live_config(config: LiveConfig | None, settings: dict[str, Any]) -> LiveConfig:
    """``config`` (default: LiveConfig()) with ``settings`` by field name; an unknown name is refused."""
    names = [f.name for f in dataclasses.fields(LiveConfig)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise InputError(
            f"unknown live runtime setting {', '.join(unknown)}; LiveConfig's fields are {', '.join(names)}"
        )
    return LiveConfig(**settings) if config is None else dataclasses.replace(config, **settings)
