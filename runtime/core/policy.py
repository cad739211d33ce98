"""Runtime policies: what the replay and the live runtime do at each MoE layer, as one value.

A :class:`Policy` names five choices (docs/design.md, "Runtime"):

- ``eviction``: the cache's eviction rule (:mod:`moecast.runtime.core.cache`: lru, lfu, score, static,
  belady);
- ``alpha``: SMoE's substitution threshold (Algorithm 1, :mod:`moecast.runtime.core.substitution`); only a
  policy that ``substitutes`` takes one, and ``alpha = 0`` leaves the routing unchanged;
- ``balancer``: what happens to a layer's misses: ``none`` loads every one, ``smoe`` splits them by
  SMoE Algorithm 2, ``presched`` by PreScope's PreSched (Algorithm 1, which also sizes the next
  layer's prefetch), ``cpu`` computes every one on the CPU;
- ``prefetch``: ``predictor`` prefetches the next layer's predicted experts, from the run's
  predictor (a checkpoint), else the runtime's own source (the oracle in replay: an upper bound;
  the next gate on this gate input in the live runtime); ``none`` never prefetches;
- ``preload``: ``hot`` starts every cache from PreScope's hot-expert table (Sec. 4.4), ``none``
  from empty (replay) or the runtime's initial placement (live).

``late_prefetch`` (with ``prefetch: predictor``): one prefetch more than the window holds is started;
it lands late but is resident, and the next layer waits for it (where a transfer takes longer than a
layer's attention, as from a disk, no prefetch fits the window otherwise).

``gate`` (with ``prefetch: predictor``): ``none`` starts every prefetch the policy asks for;
``calibrated`` starts one that would make the link late (late_prefetch's, PreSched's extra one) only
when the predictor's probability of use, calibrated on val, times the demand read it spares exceeds
the link time it takes from the demand loads, and under two expert copies at the copy that pays
most (:mod:`moecast.runtime.core.gate`, :mod:`moecast.runtime.core.mixed`).

:data:`POLICIES` holds the named presets that ``--policy`` selects in ``moecast replay``,
``compare`` and ``run``. Whether a policy substitutes, and the alpha it takes when none is given
(:func:`resolve_alpha`), is decided here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moecast.runtime.core import eviction

from moecast.errors import InputError

#: alpha for a policy that substitutes (smoe) when none is given, in ``moecast run``, ``replay`` and
#: ``compare`` alike. SMoE picks alpha per TPOT budget (Eq. 5: ``moecast eval-accuracy --tpot-budget``);
#: 0.3 is the middle of its Table IV range and kept tiny's perplexity within 0.01 % (bench ``live``).
DEFAULT_ALPHA = 0.3

# the values of each Policy field: POLICIES (below) is the presets, these the choices they combine
EVICTIONS = eviction.NAMES
BALANCERS = ("none", "smoe", "presched", "cpu")
PREFETCH = ("none", "predictor")  # Policy.prefetch (where candidates come from is a runtime's own choice)
PRELOAD = ("none", "hot")
GATES = ("none", "calibrated")


def resolve_alpha(alpha: float | None, substitutes: bool) -> float:
    """``alpha`` as given, or the default of a policy that does (DEFAULT_ALPHA) or does not (0) substitute."""
    if alpha is None:
        return DEFAULT_ALPHA if substitutes else 0.0
    return float(alpha)


@dataclass(frozen=True)
class Policy:
    """One runtime policy; see the module docstring for each field."""

    name: str
    eviction: str
    substitutes: bool = False
    alpha: float = 0.0
    balancer: str = "none"
    prefetch: str = "none"
    preload: str = "none"
    late_prefetch: bool = False
    gate: str = "none"
    help: str = ""

    def __post_init__(self) -> None:
        for what, value, allowed in (
            ("eviction", self.eviction, tuple(eviction.TABLE)),
            ("balancer", self.balancer, BALANCERS),
            ("prefetch", self.prefetch, PREFETCH),
            ("preload", self.preload, PRELOAD),
            ("gate", self.gate, GATES),
        ):
            if value not in allowed:
                raise InputError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")
        if self.late_prefetch and (self.prefetch == "none" or self.balancer == "presched"):
            raise InputError(
                f"policy {self.name!r}: late_prefetch needs prefetch predictor and a balancer other than "
                "presched (PreSched sizes its own prefetch)"
            )
        if self.gate != "none" and self.prefetch == "none":
            raise InputError(
                f"policy {self.name!r}: gate {self.gate} gates prefetches; it needs prefetch predictor"
            )
        a = self.alpha
        # the threshold on a router probability's share of the top one (SMoE Algorithm 1): 1 and above
        # would substitute experts the router ranks first; one rule for replay and the live runtime
        if not (isinstance(a, (int, float)) and math.isfinite(a) and 0 <= a < 1):
            raise InputError(f"alpha must be in [0, 1) (SMoE's substitution threshold), got {a}")
        if a > 0 and not self.substitutes:
            raise InputError(
                f"--alpha applies to substitution, which policy {self.name!r} does not use; use --policy smoe"
            )

    @property
    def substituting(self) -> bool:
        """Whether this run changes the routing (a substituting policy with alpha > 0)."""
        return self.substitutes and self.alpha > 0

    @property
    def prefetches(self) -> bool:
        return self.prefetch != "none"

    def with_alpha(self, alpha: float | None) -> Policy:
        """This policy with ``alpha`` (None: the default, :func:`resolve_alpha`)."""
        return dataclasses.replace(self, alpha=resolve_alpha(alpha, self.substitutes))


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("lru", "lru", help="LRU eviction, misses loaded on demand"),
        Policy("lfu", "lfu", help="LFU eviction (access counts since start, then recency, then id)"),
        Policy("score", "score", help="SMoE Eq. 3 score-averaged eviction with shield (needs router_probs)"),
        Policy(
            "static",
            "static",
            balancer="cpu",
            help="PreScope hot-expert table, fixed; misses computed on the CPU (the slots never change)",
        ),
        Policy("belady", "belady", help="offline optimum eviction (demand only, replay bound)"),
        Policy(
            "prefetch",
            "lru",
            prefetch="predictor",
            help="LRU + top-score prefetch (SMoE C4) from --predictor",
        ),
        Policy(
            "lfu-prefetch",
            "lfu",
            prefetch="predictor",
            help="LFU eviction + top-score prefetch from --predictor",
        ),
        Policy(
            "prefetch-late",
            "lru",
            prefetch="predictor",
            late_prefetch=True,
            help="prefetch, and one more than the window holds, which the next layer waits for (a slow link: disk)",
        ),
        Policy(
            "prefetch-gated",
            "lru",
            prefetch="predictor",
            late_prefetch=True,
            gate="calibrated",
            help="prefetch-late whose late prefetch starts only when its calibrated probability of use "
            "(fitted on val) times the demand read it spares exceeds the link time it costs",
        ),
        Policy(
            "presched",
            "lru",
            balancer="presched",
            prefetch="predictor",
            preload="hot",
            help="PreScope: hot-expert table start, LRU, PreSched Alg. 1 (Eq. 5 load/CPU split, Eqs. 6-7 prefetch sizing)",
        ),
        Policy(
            "smoe",
            "score",
            substitutes=True,
            alpha=DEFAULT_ALPHA,
            balancer="smoe",
            prefetch="predictor",
            help="SMoE: Eq. 3 eviction + Alg. 1 substitution + prefetch + Alg. 2 CPU balancing (needs router_probs)",
        ),
    )
}


def get_policy(policy: str | Policy, alpha: float | None = None) -> Policy:
    """The preset named ``policy`` (or ``policy`` itself) with ``alpha`` resolved; one line if unknown."""
    if isinstance(policy, Policy):
        return policy if alpha is None else policy.with_alpha(alpha)
    if policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[policy].with_alpha(alpha)


def substitutes(policy: str) -> bool:
    """Whether the policy named ``policy`` substitutes experts, i.e. takes an alpha."""
    return policy in POLICIES and POLICIES[policy].substitutes


def policy_help(exclude: tuple[str, ...] = ()) -> str:
    """The presets as a help text lists them: ``name (help); ...`` (POLICIES' order)."""
    return "; ".join(f"{n} ({p.help})" for n, p in POLICIES.items() if n not in exclude)


def policy_names(prefetching: bool | None = None, exclude: tuple[str, ...] = ()) -> list[str]:
    """Preset names, all or those that do (``prefetching=True``) or do not prefetch."""
    return [
        n
        for n, p in POLICIES.items()
        if n not in exclude and (prefetching is None or p.prefetches == prefetching)
    ]


def with_policies(doc: str, exclude: tuple[str, ...] = ()) -> str:
    """``doc`` with its placeholders filled from POLICIES, so no help text lists the presets by hand:
    ``<POLICY_HELP>`` each preset and its help, ``<POLICY_NAMES>`` the names, ``<PREFETCHING>`` and
    ``<NOT_PREFETCHING>`` those that do or do not prefetch (``a, b and c``)."""

    def listed(names: list[str]) -> str:
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"

    return (
        doc.replace("<POLICY_HELP>", policy_help(exclude))
        .replace("<POLICY_NAMES>", ", ".join(policy_names(exclude=exclude)))
        .replace("<NOT_PREFETCHING>", listed(policy_names(False, exclude)))
        .replace("<PREFETCHING>", listed(policy_names(True, exclude)))
    )
