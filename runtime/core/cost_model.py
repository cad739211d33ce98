"""Hardware cost model for expert offloading (PreScope Sec. 4.3.2, Eq. 3; SMoE Sec. 5.4).

Quantities (PreScope's notation):

- ``t_io``: time to move one expert host -> device over the link (Premise 4: transfers are serial,
  bandwidth saturated), ``expert_bytes / transfer bandwidth``. On an accelerator (``fast_tier:
  device``) a quantized expert is copied packed and dequantized into its slot on the transfer stream
  (:class:`moecast.runtime.tiers.precision.SlotDequantizer`), so a load holds that stream for its
  quantized bytes over the link plus ``t_dq``, the profile's ``dequant_ms[precision]`` (per expert of
  ``ref_expert_bytes``; 0 where it is not measured): ``t_io = link_bytes / bandwidth + t_dq``. A CPU
  set's read on a disk tier (``slow_tier: disk``) is charged ``t_io`` too, its dequantize included
  (an overestimate by ``t_dq`` per such read: the CPU computes those on the packed weights);
- ``t_g``: device time of one resident expert, flat in the token count at decode batch sizes
  (PreScope Fig. 13, Premise 5). On an accelerator it is ``gpu_expert_ms`` at every precision: the
  slots hold the dequantized weights, which compute as the model's. Where the CPU is the fast tier
  the resident expert is the CPU expert at one token, computed on the packed weights by the weight-
  only kernels, whose time ``expert_ms`` holds per precision (``int8``, ``int4-g128``;
  :meth:`HardwareProfile.expert_time`), so a precision's ``t_c = beta * m + (expert_ms[precision] -
  beta)``; a precision the profile does not name is charged the model dtype's time;
- ``t_c(m) = beta * m + C``: CPU time of one expert over ``m`` tokens (PreScope Eq. 3; SMoE Fig. 8);
- ``t_attn``: per-layer non-expert device time (attention, gate, shared experts);
- ``predictor_ms``: the prefetch predictor's per-layer latency on the host (optional, default 0):
  the replay charges it before a prefetch may start (:mod:`moecast.runtime.core.step`);
- ``read_cpu_ms`` (``t_rc``): the compute time one expert read takes from the cores while it runs
  (optional, default 0). It applies where the CPU both computes and reads (``fast_tier: cpu``,
  ``slow_tier: disk``): the I/O threads and the kernel's block layer then share the cores with
  the experts' and the attention's kernels. ``moecast profile`` measures it as the CPU time a read
  takes on its reading thread, plus the machine's interrupt time per read, while experts compute;
- ``load_host_ms`` (``t_rc`` of a device fast tier over host memory): the host's own time to issue
  one expert load to an accelerator (optional, default 0): the runtime's copy path (the copy call
  and its events, a staging fill where the host copy is not pinned; a run's ``copy_issue_ms``).
  While it issues a copy the host launches nothing else, and a decode step on a fast device waits
  on its host (issue 43: the H200's rows are host-bound), so each copy adds it to a layer, as a
  read's ``t_rc`` does on a CPU fast tier: a demand load to its own, a prefetch to the layer it
  prefetches for. ``moecast profile`` measures it on CUDA with the runtime's own store; ``0``
  where it is not measured. A disk tier's copies are issued by its I/O threads, so over a disk it
  is not charged;
- ``step_ms`` (``t_step``): per decode step, the time after the last MoE layer's experts (its
  shared experts and residual, the final norm, the LM head; optional, default 0). It ends the
  step, so no prefetch overlaps it: a step costs its layers' times plus ``t_step``. Spread over the
  layers as attention instead, it would widen every prefetch window by ``t_step / L`` (a quarter
  of it on a 4-layer model).

Where the tiers are (:mod:`moecast.runtime.core.step`, step 5, reads them):

- ``fast_tier``: ``device`` (an accelerator computes the resident experts while the CPU computes
  its own set: the two overlap) or ``cpu`` (no accelerator: resident experts are computed by the
  same cores as the CPU set, so their times add);
- ``slow_tier``: ``host`` (the CPU computes a non-resident expert from host memory) or ``disk``
  (the experts that are not resident live on a disk: a CPU-computed expert is read over the link
  first, behind the layer's demand loads).

Profiles are YAML files under ``configs/hardware/`` (the papers' settings) or written by
``moecast profile`` (this machine). Times in a profile are for an expert of ``ref_expert_bytes``
bytes; :class:`CostModel` scales compute and transfer times linearly to the model's expert size.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from moecast import configs_dir
from moecast.errors import InputError

#: a precision's tag as profiles name it (runtime/tiers/precision.py, Precision.tag)
_PRECISION_TAG = re.compile(r"int8|int4-g\d+")


class ProfileError(InputError):
    """An unknown, unreadable or malformed hardware profile."""


@dataclass
class HardwareProfile:
    """One accelerator + host + link setting; see the module docstring for the meaning of each field."""

    name: str
    transfer_gbps: float  # effective host-to-device bandwidth in GB/s (1e9 bytes); 0 = no link, inf = free
    ref_expert_bytes: int
    gpu_expert_ms: float
    cpu_beta_ms: float
    cpu_c_ms: float
    attn_ms: float
    source: str = ""
    # the prefetch predictor's latency per layer on this host (ms), charged before a prefetch may start
    predictor_ms: float = 0.0
    # direct-read bandwidth of the disk that holds offloaded experts (GB/s); 0 = not measured
    disk_read_gbps: float = 0.0
    # compute time an expert read takes from the cores that compute (ms); cpu fast tier + disk only
    read_cpu_ms: float = 0.0
    # the host's time to issue one expert load to an accelerator (ms); device fast tier only, 0 = unmeasured
    load_host_ms: float = 0.0
    # per decode step, the time after the last MoE layer's experts (final norm, LM head), in no window
    step_ms: float = 0.0
    fast_tier: str = "device"  # device | cpu: where resident experts compute (module docstring)
    slow_tier: str = "host"  # host | disk: where the other experts live
    # a resident expert's time at each precision other than the model's dtype (tag -> ms per
    # expert of ref_expert_bytes), measured on the CPU's weight-only kernels (a cpu fast tier's)
    expert_ms: dict[str, float] = field(default_factory=dict)
    # the device's time to dequantize one loaded expert into its slot at each quantized precision (tag
    # -> ms per expert of ref_expert_bytes; a device fast tier's loads); a tag absent: 0, unmeasured
    dequant_ms: dict[str, float] = field(default_factory=dict)

    TIERS: ClassVar[dict[str, tuple[str, ...]]] = {
        "fast_tier": ("device", "cpu"),
        "slow_tier": ("host", "disk"),
    }

    def __post_init__(self) -> None:
        for f in (
            "transfer_gbps", "gpu_expert_ms", "cpu_beta_ms", "cpu_c_ms", "attn_ms", "predictor_ms", "disk_read_gbps",
            "read_cpu_ms", "load_host_ms", "step_ms",
        ):  # fmt: skip
            v = float(getattr(self, f))
            if math.isnan(v) or v < 0:
                raise ProfileError(f"hardware profile {self.name!r}: {f} = {v}, expected a number >= 0")
            setattr(self, f, v)
        for f, allowed in self.TIERS.items():
            if getattr(self, f) not in allowed:
                raise ProfileError(
                    f"hardware profile {self.name!r}: {f} = {getattr(self, f)!r}, expected one of {', '.join(allowed)}"
                )
        if int(self.ref_expert_bytes) <= 0:
            raise ProfileError(f"hardware profile {self.name!r}: ref_expert_bytes must be > 0")
        self.ref_expert_bytes = int(self.ref_expert_bytes)
        self.expert_ms = self._precision_times(self.expert_ms)
        self.dequant_ms = self._precision_times(self.dequant_ms, "dequant_ms")

    def _precision_times(self, given: Any, what: str = "expert_ms") -> dict[str, float]:
        if not isinstance(given, dict):
            raise ProfileError(
                f"hardware profile {self.name!r}: {what} = {given!r}, expected a mapping of precision to ms"
            )
        out = {}
        for tag, ms in given.items():
            v = float(ms)
            if not _PRECISION_TAG.fullmatch(str(tag)) or math.isnan(v) or v < 0:
                raise ProfileError(
                    f"hardware profile {self.name!r}: {what}[{tag!r}] = {ms!r}, expected a precision "
                    "(int8, int4-gN) and a number >= 0"
                )
            out[str(tag)] = v
        return out

    def expert_time(self, precision: str = "model") -> float:
        """A resident expert's time (ms, per expert of ``ref_expert_bytes``) computed at ``precision``
        (a tag: ``model``, ``int8``, ``int4-g128``): on an accelerator the model dtype's
        ``gpu_expert_ms`` (its slots hold dequantized weights); on a CPU fast tier the profile's own
        where it measured one, else ``gpu_expert_ms``."""
        if self.fast_tier == "device":
            return self.gpu_expert_ms
        return self.expert_ms.get(precision, self.gpu_expert_ms)

    def dequant_time(self, precision: str = "model") -> float:
        """The device's time (ms, per expert of ``ref_expert_bytes``) to dequantize a loaded expert into
        its slot at ``precision``: ``dequant_ms``'s entry on an accelerator, else 0 (the CPU computes on
        the packed slots; the model's dtype and an unmeasured precision need none)."""
        return self.dequant_ms.get(precision, 0.0) if self.fast_tier == "device" else 0.0

    def cpu_c_at(self, precision: str = "model") -> float:
        """The CPU expert's start-up ``C`` at ``precision``: where the CPU is the fast tier and the
        profile timed that precision, its one-token time less beta (module docstring)."""
        if self.fast_tier == "cpu" and precision in self.expert_ms:
            return max(self.expert_ms[precision] - self.cpu_beta_ms, 0.0)
        return self.cpu_c_ms

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)


def _profile_dirs() -> list[Path]:
    from moecast import home

    # shipped paper settings, then profiles measured here by `moecast profile`
    return [configs_dir() / "hardware", home() / "hardware"]


#: the profile a run models time on when it names none and ``moecast profile`` has measured no
#: ``local`` profile here: PreScope's A100 on PCIe 4, a common host-to-GPU link, with each value
#: cited in its file. The replay and the live runtime share it, so one configuration means one
#: machine in both.
DEFAULT_HARDWARE = "prescope-a100-pcie4"
#: the name ``moecast profile`` gives this machine's profile by default
LOCAL_PROFILE = "local"


def default_hardware() -> tuple[str, str]:
    """(profile, why) for a run that names none: this machine's measured profile where ``moecast
    profile`` wrote one (``$MOECAST_HOME/hardware/local.yaml``), else :data:`DEFAULT_HARDWARE`."""
    from moecast import home

    if (home() / "hardware" / f"{LOCAL_PROFILE}.yaml").is_file():
        return LOCAL_PROFILE, "this machine's profile (moecast profile)"
    return DEFAULT_HARDWARE, "the default; measure this machine with moecast profile"


def available_profiles() -> list[str]:
    return sorted({p.stem for d in _profile_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A profile by name (``configs/hardware/<name>.yaml``) or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        found = [
            d / f"{name_or_path}.yaml" for d in _profile_dirs() if (d / f"{name_or_path}.yaml").is_file()
        ]
        path = found[0] if found else configs_dir() / "hardware" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ProfileError(
            f"unknown hardware profile {str(name_or_path)!r}; use one of {', '.join(available_profiles())} "
            "or a YAML path (write one for this machine with `moecast profile`)"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
        raise ProfileError(
            f"{path}: malformed YAML ({first}); fix or regenerate it with `moecast profile`"
        ) from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping of profile fields, got {type(data).__name__}")
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    optional = (
        "source",
        "predictor_ms",
        "disk_read_gbps",
        "read_cpu_ms",
        "load_host_ms",
        "step_ms",
        "fast_tier",
        "slow_tier",
        "expert_ms",
        "dequant_ms",
    )
    missing = sorted(f.name for f in fields(HardwareProfile) if f.name not in data and f.name not in optional)
    if unknown or missing:
        raise ProfileError(
            f"{path}: "
            + (f"unknown fields {unknown}" if unknown else "")
            + ("; " if unknown and missing else "")
            + (f"missing fields {missing}" if missing else "")
            + f"; expected {sorted(known)}"
        )
    try:
        return HardwareProfile(**data)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ProfileError):
            raise
        raise ProfileError(f"{path}: bad value ({exc}); fix or regenerate it with `moecast profile`") from exc


@dataclass
class CostModel:
    """Per-expert times (ms) for a model's expert size on a hardware profile."""

    t_io: float
    t_g: float
    beta: float
    c: float
    t_attn: float
    expert_bytes: int
    profile: str = ""
    shared_compute: bool = False  # fast_tier cpu: resident and CPU experts share the cores (times add)
    cpu_reads_link: bool = False  # slow_tier disk: a CPU-computed expert is read over the link first
    # what one transfer takes from the step beside it: a read's compute time on the cores (cpu fast tier
    # reading a disk), or the host's time to issue a copy to an accelerator (device fast tier)
    t_rc: float = 0.0
    t_step: float = 0.0  # per decode step, after the last MoE layer (final norm, LM head)
    t_dq: float = 0.0  # of t_io: the device's dequantize of a quantized load into its slot

    @classmethod
    def from_profile(
        cls,
        profile: HardwareProfile,
        expert_bytes: int,
        link_bytes: int | None = None,
        precision: str = "model",
    ) -> CostModel:
        """Times for an expert of ``expert_bytes`` in the model's dtype that the link moves as
        ``link_bytes`` (default the same; fewer where the slow tier stores a quantized copy) and that
        computes at ``precision`` (a tag; :meth:`HardwareProfile.expert_time`): compute scales with
        the former, a transfer and a read's CPU time with the latter. A load on an accelerator also
        holds the transfer stream for its dequantize (:meth:`HardwareProfile.dequant_time`, scaled with
        the former)."""
        scale = expert_bytes / profile.ref_expert_bytes
        link = int(expert_bytes if link_bytes is None else link_bytes)
        t_dq = profile.dequant_time(precision) * scale
        if profile.transfer_gbps == 0:
            t_io = math.inf
        else:
            t_io = link / (profile.transfer_gbps * 1e9) * 1e3 + t_dq
        cpu_reads = (profile.fast_tier, profile.slow_tier) == ("cpu", "disk")
        return cls(
            t_io=t_io,
            t_g=profile.expert_time(precision) * scale,
            beta=profile.cpu_beta_ms * scale,
            c=profile.cpu_c_at(precision) * scale,
            t_attn=profile.attn_ms,
            expert_bytes=link,
            profile=profile.name,
            shared_compute=profile.fast_tier == "cpu",
            cpu_reads_link=profile.slow_tier == "disk",
            # a device's copies take the host's issue time, whatever their size; a host tier's pinned
            # reads on a CPU fast tier leave the cores alone
            t_rc=_transfer_cost(profile, link, cpu_reads),
            t_step=profile.step_ms,
            t_dq=t_dq,
        )

    def t_cpu(self, tokens: Any) -> Any:
        """PreScope Eq. 3: CPU time of one expert over ``tokens`` tokens (vectorised; 0 tokens cost 0)."""
        import numpy as np

        m = np.asarray(tokens, dtype=np.float64)
        return np.where(m > 0, self.beta * m + self.c, 0.0)


def _transfer_cost(profile: HardwareProfile, link: int, cpu_reads: bool) -> float:
    """``t_rc`` of a transfer of ``link`` bytes (module docstring): a CPU fast tier's read share, scaled
    to its bytes, or a device's issue time per copy."""
    if cpu_reads:
        return profile.read_cpu_ms * link / profile.ref_expert_bytes
    # a disk tier's copies are issued by its I/O threads, not by the host's thread that launches the step
    return profile.load_host_ms if (profile.fast_tier, profile.slow_tier) == ("device", "host") else 0.0
