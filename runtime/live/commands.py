"""``moecast run`` and ``moecast eval-accuracy``: the live runtime on a real model from the command line.

``run`` generates from a prompt with the runtime attached and reports hit rate,
substitution rate, transfers, CPU-computed experts and TPOT (measured on this machine
and modeled on the hardware profile, separately).

``eval-accuracy`` is SMoE Table IV for a model without task labels: for each alpha, the
perplexity of held-out text and the greedy next-token agreement with alpha = 0, both
computed token by token through the KV cache so that every token is a decode step (the
phase where SMoE substitutes), plus the substitution rate and modeled TPOT. With
``--precisions`` it repeats the sweep with the experts at int8 / int4
(:mod:`moecast.runtime.tiers.precision`), and with two copies (``mixed``: the model-dtype and the int4
copy, :mod:`moecast.runtime.core.mixed`), every row measured against the model-precision experts at
alpha 0. With ``--tpot-budget`` it picks alpha by SMoE Eq. 5 (:mod:`moecast.runtime.core.alpha`).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moecast.collect.models import kv_cache, with_cache
from moecast.runtime.core.policy import resolve_alpha, substitutes, with_policies
from moecast.runtime.core.spec import DEFAULT
from moecast.runtime.live.attach import check_learning
from moecast.runtime.live.config import LiveConfig
from moecast.runtime.live.runtime import attach
from moecast.runtime.tiers.precision import Precision, TwoCopies, expert_setting, experts_at
from moecast.runtime.tiers.registry import TIERS, tier_help

from moecast.errors import InputError
from moecast.jsonout import dumps


class RunWarning(UserWarning):
    """A run that goes ahead otherwise than its user likely meant (said in one line)."""


def _threads() -> None:
    # the machines moecast targets share a few cores; one thread keeps runs predictable
    torch.set_num_threads(int(os.environ.get("MOECAST_THREADS", "1")))


def _load_predictor(path: str | None) -> Any:
    """The checkpoint at ``path`` (None for none: ``none``, as replay and compare take it)."""
    if not path or path == "none":
        return None
    from moecast.predictors.registry import load

    return load(path)


def _check_jobs(pred: Any, plan: Any, config: LiveConfig) -> None:
    """Refuse a predictor that cannot do the job ``run`` gives it, in the words ``attach`` would use:
    a planner that is no prompt-ahead planner, a prefetcher that cannot stream or (under a gated policy)
    has no calibration; under static the predictor is the table the policy pins, which must be one
    (attach checks its shape against the model's)."""
    from moecast.predictors.base import StreamingPredictor
    from moecast.runtime.core.cache import hot_table
    from moecast.runtime.live.prefetch import (
        check_planner,
        choose_prefetch,
        gate_calibration,
        not_a_prefetcher,
    )

    check_planner(plan)
    rule = config.rule()
    if rule.eviction == "static":
        if pred is not None:  # an [L, E] table of its own layers and experts (attach: of the model's)
            hot_table(pred, pred.num_layers, pred.num_experts)
        return
    if pred is not None and config.prefetch != "none" and not isinstance(pred, StreamingPredictor):
        raise InputError(not_a_prefetcher(pred))
    gate_calibration(rule, choose_prefetch(config.prefetch, rule, pred, None), pred)


def _check_model(ckpt: Any, path: str | None, model: Any, name: str) -> None:
    """Refuse a checkpoint made for another model than the loaded one."""
    if ckpt is None:
        return
    from moecast.collect.models import find_moe_structure, model_info
    from moecast.predictors.checkpoint import check_fingerprint

    fp = model_info(model, find_moe_structure(model), name).fingerprint
    check_fingerprint(ckpt.checkpoint_meta, fp, f"model {name}", path)


def _rate(x: float | None) -> str:
    """A rate to two places, or '-' where it is undefined (nothing to count it over)."""
    return "-" if x is None or x != x else f"{x:.2f}"


def _slots(stats: dict[str, Any]) -> str:
    """How a capacity in bytes was counted: a slot here holds what this run computes on (a device's
    dequantized expert, the CPU's packed copy), which a replay's profile may count otherwise."""
    from moecast.runtime.core.cache import in_bytes

    given = stats.get("capacity_given")
    if not in_bytes(given):
        return ""
    return f" ({given.strip()} at {stats['slot_bytes'] / 1024:.1f} KiB a slot, as this run's slots hold them)"


def _print_stats(stats: dict[str, Any]) -> None:
    rows = [
        (
            "policy / capacity",
            f"{stats['policy']}, {stats['capacity']} of {stats['num_experts']} experts per layer{_slots(stats)}",
        ),
        ("alpha / prefetch", f"{stats['alpha']:.2f} / {stats['prefetch']}"),
        ("decode steps", f"{stats['decode_steps']}"),
        (
            "hit rate",
            f"{stats['hit_rate']:.3f}  ({stats['hits']} of {stats['uses']} expert uses, first uses included)",
        ),
        (
            "substitution rate",
            f"{stats['substitution_rate']:.3f}  ({stats['substituted']} of {stats['routed']} decode uses)",
        ),
        (
            "transfers",
            f"{stats['transfers']}  ({stats['loads']} on demand, {stats['prefetches_landed']} of "
            f"{stats['prefetches_issued']} prefetches landed{_refused(stats)}, accuracy "
            f"{_rate(stats['prefetch_accuracy'])})",
        ),
        ("CPU-computed experts", f"{stats['cpu_experts']}  ({stats['cpu_uses']} token uses)"),
        ("TPOT measured", f"{stats['measured_tpot_ms']:.2f} ms  (this machine, {stats['device']})"),
        (
            "TPOT modeled",
            f"{stats['modeled_tpot_ms']:.3f} ms  (hardware profile {stats['hardware']}: {stats['hardware_from']})",
        ),
    ]
    if stats.get("plan_loads"):
        rows.insert(5, ("plan preload", f"{stats['plan_loads']} experts loaded before decoding"))
    if "plan_buffered" in stats:
        folded = "folded into the index now; " if stats["plans_folded"] else ""
        rows.append(
            (
                "plan buffer",
                f"{folded}{stats['plan_buffered']} of {stats['plan_buffer_size']} prompts buffered, "
                f"index holds {stats['plan_index_size']}",
            )
        )
    tier = TIERS.get(stats.get("offload"))
    if tier is not None:  # what the slow tier did, in its own words
        rows += tier.report(stats)
    if "expert_dtype" in stats:  # every tier: host memory on an accelerator holds quantized experts too
        rows.append(("expert precision", _precision_line(stats)))
        if stats.get("low_share") is not None:  # two copies: where the uses ran and what each copy read
            moved = ", ".join(f"{tag} {b / 2**20:.1f} MiB" for tag, b in stats["bytes_by_copy"].items())
            rows.append(
                (
                    "two copies",
                    f"{100 * stats['low_share']:.1f}% of the uses at the low copy, {stats['upgrades']} upgrades; "
                    f"read {moved}",
                )
            )
        rows.append(("wasted prefetch", f"{stats['wasted_bytes'] / 2**20:.1f} MiB (prefetched, never used)"))
    rows.append(("peak RSS", f"{stats['peak_rss_mb']:.0f} MiB"))
    parts = ("attention", "expert_compute", "transfer_wait", "device_sync", "predictor", "policy")
    rows.append(
        (
            "decode step split",
            ", ".join(f"{p.replace('_', ' ')} {stats[p + '_ms']:.2f}" for p in parts) + " ms",
        )
    )
    if stats.get("link_gbps_observed"):
        # the copies into the slots as the device's events timed them, and its kernels' wait for them
        if stats.get("device_ops") == "simulated":
            where = "simulated link"
        else:  # without an accelerator the copies are the host's, within its memory
            where = "host memory copies" if stats.get("simulated_device") else "link"
        rows.append(
            (
                "link",  # every copy since attach: the slots' initial fill too, which "transfers" leaves out
                f"{stats['link_bytes'] / 2**20:.1f} MiB in {stats['link_ms']:.2f} ms, the initial fill of the "
                f"slots included ({where} "
                f"{stats['link_gbps_observed']:.1f} GB/s); device wait {stats['stream_wait_ms']:.3f} ms a step"
                # a copy whose read lands in the background is queued once it has, so the device waits for both
                + (
                    f", the {tier.name} tier's reads included"
                    if tier is not None and tier.background_reads
                    else ""
                ),
            )
        )
    if stats.get("online_updates"):
        rows.append(
            ("online learning", f"{stats['online_updates']} steps, last loss {stats['online_loss']:.4f}")
        )
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def _size(nbytes: float) -> str:
    """A size with three significant figures in the unit that keeps it readable (an int4 expert of a
    small model is a few KiB)."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def _refused(stats: dict[str, Any]) -> str:
    """The late prefetches the gate held back (issued, never started: not a lost read)."""
    n = stats.get("gate_refused") or 0
    return f" ({n} held back by the prefetch gate)" if n else ""


def _precision_line(stats: dict[str, Any]) -> str:
    """The slow tier's precision and an expert's bytes at it (two copies: both copies')."""
    if stats.get("low_expert_bytes") is not None:
        high, low = stats["expert_dtype"].split("+", 1)
        return (
            f"{stats['expert_dtype']} ({_size(stats['expert_bytes'])} an expert at {high}, "
            f"{_size(stats['low_expert_bytes'])} at {low})"
        )
    return f"{stats['expert_dtype']} ({_size(stats['expert_bytes'])} an expert)"


def run(
    model: str = "tiny",
    prompt: str = "Explain how a mixture-of-experts language model works.",
    predictor: str | None = None,
    planner: str | None = None,
    policy: str = DEFAULT.policy,
    alpha: float | None = DEFAULT.alpha,
    capacity: str = str(DEFAULT.capacity),
    prefetch: str = "auto",
    balance: str | None = None,
    hardware: str | None = DEFAULT.hardware,
    predictor_ms: float | None = DEFAULT.predictor_ms,
    max_new_tokens: int = 32,
    online_update: bool = False,
    learn_plans: bool = False,
    offload: str = "ram",
    offload_dir: str | None = None,
    expert_dtype: str = DEFAULT.expert_dtype,
    group_size: int = DEFAULT.group_size,
    router_pattern: str | None = None,
    device_ops: str = "auto",
    graphs: bool = True,
    pinned_mb: float | None = None,
    json: bool = False,
) -> dict[str, Any]:
    """Generate text with the live runtime attached and report its cache, substitution and TPOT figures.

    Args:
        model: ``tiny`` (the embedded default), ``tiny:PRESET`` or a local Hugging Face model directory.
        prompt: Prompt text.
        predictor: Layer-ahead predictor checkpoint (LLaPor) for prefetch; under ``--policy static``, a
            frequency checkpoint whose table pins each layer's top experts; under ``--policy prefetch-gated``, one
            carrying the gate's calibration (``moecast predictors calibrate``). Checked against the model's fingerprint.
        planner: Prompt-ahead checkpoint with a plan (CasMoE EAM, EAP or cascade, hot): its plan for the prompt is preloaded before decoding.
        policy: a policy of ``moecast replay`` but belady: <POLICY_HELP>.
        alpha: SMoE substitution threshold in [0, 1) for policy smoe (default 0.3, as in replay and compare); 0 leaves the routing
            unchanged. Other policies do not substitute (as in ``moecast replay``) and refuse alpha > 0.
        capacity: Experts per layer on the device: fraction (0.25), count (6), bytes (512MB) or ``all``.
        prefetch: where prefetch candidates come from: auto (if the policy prefetches: --predictor if given,
            else online), none, online (next gate on the current gate input, SMoE §IV-C) or predictor.
        balance: overrides the policy's balancer for decode misses: smoe (SMoE Algorithm 2), presched
            (PreScope's PreSched: load/CPU split with the predicted next layer's experts in the link queue,
            and the prefetch count), load (always load) or cpu (always compute on the CPU).
        hardware: Hardware profile (configs/hardware name or YAML path) for modeled times; default: this
            machine's (``moecast profile`` writes ``local``), else prescope-a100-pcie4, as ``moecast replay``.
        predictor_ms: the predictor's latency per layer (ms) charged before a prefetch may start (default:
            a figure the checkpoint's header carries, else the hardware profile's, which ``moecast profile
            --predictor CKPT`` times on this machine), as in ``moecast replay``.
        max_new_tokens: Tokens to generate (greedy).
        online_update: Continual learning of the predictor on each decoded token (PreScope §4.2.2).
        learn_plans: CasMoE's buffer: the prompt and the EP of its prefill go to the planner's EAM, which
            folds every C (its buffer_size, paper 30) into its index and rewrites its checkpoint files.
        offload: Where the experts that are not resident live: <TIER_HELP>. Under disk the experts are
            written to DIR once (that run loads the whole model; later runs load only its other weights),
            and only ``capacity`` experts per layer are in memory.
        offload_dir: The offload directory for ``--offload disk`` (created if absent; a re-run resumes an
            interrupted write; another model's directory is refused).
        expert_dtype: Precision of the offloaded experts: model (the model's dtype, exact), int8 (per output
            channel) or int4 (group-wise, ``--group-size``; int4-g64 names the group too), or mixed (model
            and int4 copies; HIGH+LOW such as int8+int4; ``--offload disk``). On the disk the directory
            keeps each precision beside the model-dtype copy; on the CPU the experts compute on the
            packed weights, on a GPU (``--offload ram`` too) the packed bytes cross the link and are
            dequantized into the slot.
        group_size: int4's group along each matrix's input dimension: 32, 64, 128 or 256; a matrix whose
            inputs it does not divide is quantized per output channel, and a warning says so.
        router_pattern: Regex over module names naming the routers, for a model whose routers transformers'
            ``_can_record_outputs`` does not name (its experts must still use the experts interface).
        device_ops: How copies reach the slots: auto (CUDA's streams on a GPU, else synchronous copies) or
            simulated (on the CPU, the GPU path's streams and events simulated: the same copies and waits,
            in the same order, timed on a link at the hardware profile's rate).
        graphs: On an accelerator, replay each layer's decode experts call as a graph captured once (one
            launch instead of the implementation's kernels); false: call it every time.
        pinned_mb: On an accelerator, host memory (MB) the expert copies may pin (default: half the memory
            available); a layer over it keeps its copies pageable and stages each transfer.
        json: Print one JSON object instead of text and a table.
    """
    _threads()
    cap: Any = None if str(capacity).lower() in ("all", "none", "full") else capacity
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    alpha = resolve_alpha(alpha, substitutes(policy))
    # a bad precision is refused before the model loads or any write
    prec = expert_setting(expert_dtype, group_size)
    copies = [prec.high, prec.low] if isinstance(prec, TwoCopies) else [prec]
    if int(group_size) != DEFAULT.group_size and all(c.dtype != "int4" for c in copies):
        msg = f"--group-size groups int4 weights only; --expert-dtype {expert_dtype} has none"
        warnings.warn(RunWarning(msg), stacklevel=2)
    # the settings that need no model, checked before it loads (minutes for a real one): the policy's,
    # and each tier's own check (a directory the tier reads none of, a precision it cannot hold)
    config = LiveConfig(
        policy=policy, capacity=cap, alpha=alpha, prefetch=prefetch, balance=balance, offload=offload,
        offload_dir=offload_dir, expert_dtype=expert_dtype, group_size=group_size, device_ops=device_ops,
        pinned_mb=pinned_mb,
    )  # fmt: skip
    # the checkpoints are read before the model, whose load takes minutes: a wrong path or a checkpoint
    # for another job fails now; which model they were made for is checked once it is loaded
    pred, plan = _load_predictor(predictor), _load_predictor(planner)
    _check_jobs(pred, plan, config)
    check_learning(pred, plan, online_update, learn_plans)
    lm, tok, name = _load_for_run(model, offload, offload_dir)
    for ckpt, given in ((pred, predictor), (plan, planner)):
        _check_model(ckpt, given, lm, name)
    if policy == "static" and pred is None:
        warnings.warn(
            RunWarning(
                "policy static without --predictor pins experts 0..c-1 of every layer, not the hot ones; "
                "pass a frequency checkpoint (moecast predictors eval frequency --save CKPT)"
            ),
            stacklevel=2,
        )
    rt = attach(
        lm,
        policy=policy,
        capacity=cap,
        alpha=alpha,
        predictor=pred,
        hardware=hardware,
        prefetch=prefetch,
        balance=balance,
        predictor_ms=predictor_ms,
        planner=plan,
        online_update=online_update,
        learn_plans=learn_plans,
        offload=offload,
        offload_dir=offload_dir,
        expert_dtype=expert_dtype,
        group_size=group_size,
        router_pattern=router_pattern,
        device_ops=device_ops,
        graphs=graphs,
        pinned_mb=pinned_mb,
    )
    try:
        branch = rt.plan(prompt) if plan is not None else None
        if branch is not None and not json:
            print(f"plan: {branch} answered; {rt.stats()['plan_loads']} experts preloaded")
        text = _generate(lm, tok, prompt, max_new_tokens)
        stats = rt.stats()
    finally:
        rt.detach()
    result = {"model": name, "prompt": prompt, "output": text, **stats}
    if learn_plans:  # where the planner's buffer stands (a cascade buffers in its EAM)
        eam = getattr(plan, "eam", plan)
        result.update(
            plan_buffered=len(eam.buffer), plan_buffer_size=eam.config.buffer_size, plan_index_size=eam.size
        )
    if json:
        print(dumps(result))
    else:
        print(f"{prompt}\n--> {text}\n")
        _print_stats(result)
    return result


def _load_for_run(model: str, offload: str, offload_dir: str | None) -> tuple[Any, Any, str]:
    """(model, tokenizer, name) for ``moecast run``: whole, or with ``offload`` disk its other weights
    only where ``offload_dir`` already holds its experts."""
    from moecast.collect.models import load_model

    if offload == "disk":
        from moecast.runtime.tiers.offload import load_offloaded

        if not offload_dir:
            raise InputError("--offload disk needs --offload-dir DIR (where the experts are written once)")
        return load_offloaded(model, offload_dir, dtype="float32")
    if offload not in TIERS:
        raise InputError(f"unknown --offload {offload!r}; choose one of {', '.join(TIERS)}")
    return load_model(model, dtype="float32")


def _generate(lm: Any, tok: Any, prompt: str, max_new_tokens: int) -> str:
    """Exactly ``max_new_tokens`` greedy tokens after ``prompt``, decoded to text."""
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = lm.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc.get("attention_mask"),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


# ----------------------------------------------------------------------------- accuracy


def heldout_rows(
    tokenizer: Any, workloads: Sequence[str], texts: int, tokens: int, data_dir: str | None = None
) -> list[list[int]]:
    """Token rows of held-out text: ShareGPT's validation conversations, or a workload's prompts
    (read from ``data_dir`` as ``moecast collect --data-dir`` reads them)."""
    rows: list[list[int]] = []
    names = [workloads] if isinstance(workloads, str) else workloads  # one name, not its letters
    for name in [w.strip() for w in names if w.strip()]:
        if name == "sharegpt":
            from moecast.collect.sharegpt import training_texts

            source = training_texts(split="val", val_fraction=0.02, max_chars_per_text=4 * tokens * 4)
        else:
            from moecast.collect.workloads import get_spec, load_requests

            source = (r.prompt for r in load_requests(get_spec(name), data_dir, limit=texts))
        n = 0
        for text in source:
            ids = tokenizer(text)["input_ids"][:tokens]
            if len(ids) >= 8:
                rows.append(ids)
                n += 1
            if n >= texts:
                break
    if not rows:
        raise InputError(
            f"workloads {', '.join(workloads)} gave no text of at least 8 tokens; choose another workload"
        )
    return rows


@torch.no_grad()
def teacher_forced(model: Any, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Feed each row token by token through the KV cache: (log-prob of each next token, greedy argmax)."""
    nll, greedy = [], []
    for row in rows:
        past = None
        for t in range(len(row) - 1):
            out = model(input_ids=torch.tensor([[row[t]]]), **with_cache(model, past), use_cache=True)
            past = kv_cache(out)
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            nll.append(-float(logp[row[t + 1]]))
            greedy.append(int(logp.argmax()))
    return np.array(nll), np.array(greedy)


#: what every row's perplexity change and agreement are measured against
REFERENCE = {"expert_dtype": "model", "alpha": 0.0}


def sweep(
    model: Any,
    rows: list[list[int]],
    alphas: list[float],
    progress: bool = True,
    precisions: Sequence[Precision] = (Precision(),),
    **attach_kwargs: Any,
) -> list[dict[str, Any]]:
    """One result per (precision, alpha): perplexity, its change and the greedy agreement against the
    model-precision experts at alpha = 0 (:data:`REFERENCE`, measured first: alpha 0 and the model
    precision are always added), substitution rate, hit rate, TPOTs.

    Each precision's alphas run inside :func:`~moecast.runtime.tiers.precision.experts_at`, so the runtime
    attached for them holds that precision's weights and the model is restored after them. Two copies
    (:class:`~moecast.runtime.tiers.precision.TwoCopies`) run through the disk tier on a temporary offload
    directory, written once: which copy computes a use depends on the cache, so only the live runtime
    holding both copies gives their figures."""
    from tqdm import tqdm

    grid = sorted({0.0, *(float(a) for a in alphas)})
    precs = with_reference(precisions)
    bar = tqdm(total=len(precs) * len(grid), desc="alphas", disable=not progress)
    reference, results = None, []
    for prec in precs:
        with _holding(model, prec) as tier:
            for a in grid:
                bar.set_postfix_str(prec.label)
                nll, greedy, stats = _measure(model, rows, a, {**attach_kwargs, **tier})
                if reference is None:  # the first run: model precision, alpha 0
                    reference = (nll, greedy)
                results.append({"expert_dtype": prec.label, **_result(a, nll, greedy, stats, reference)})
                bar.update()
    bar.close()
    return results


@contextlib.contextmanager
def _holding(model: Any, prec: Precision) -> Iterator[dict[str, Any]]:
    """The attach settings that run ``prec``'s experts: one precision's weights swapped in memory
    (:func:`experts_at`, no settings), or two copies on the disk tier in a temporary offload directory
    (removed after)."""
    if not isinstance(prec, TwoCopies):
        with experts_at(model, prec):
            yield {}
        return
    # the tier's note that it writes the directory goes to stderr: stdout holds the sweep's rows (--json)
    with tempfile.TemporaryDirectory(prefix="moecast-copies-") as d, contextlib.redirect_stdout(sys.stderr):
        yield {"offload": "disk", "offload_dir": d, **prec.settings()}


def with_reference(precisions: Sequence[Precision]) -> list[Precision]:
    """The precisions to sweep, the model's first (the reference), each tag once."""
    out: dict[str, Precision] = {"model": Precision()}
    for p in precisions:
        out.setdefault(p.label, p)
    return list(out.values())


def _measure(
    model: Any, rows: list[list[int]], alpha: float, attach_kwargs: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(NLL of each next token, greedy argmax, runtime stats) of the rows with the runtime at ``alpha``."""
    rt = attach(model, alpha=alpha, **attach_kwargs)
    try:
        nll, greedy = teacher_forced(model, rows)
        stats = rt.stats()
    finally:
        rt.detach()
    return nll, greedy, stats


def _result(
    alpha: float,
    nll: np.ndarray,
    greedy: np.ndarray,
    stats: dict[str, Any],
    reference: tuple[np.ndarray, np.ndarray],
) -> dict[str, Any]:
    """One sweep row; perplexity change and agreement are against ``reference`` (its NLL and greedy)."""
    ppl = float(math.exp(nll.mean()))
    change = ppl / math.exp(reference[0].mean()) - 1
    return {
        "alpha": alpha,
        "perplexity": ppl,
        "perplexity_change": change,
        "ppl_change_pct": 100 * change,
        "agreement": float((greedy == reference[1]).mean()),
        "reference": dict(REFERENCE),
        "substitution_rate": stats["substitution_rate"],
        "hit_rate": stats["hit_rate"],
        "transfers_per_token": stats["transfers"] / max(1, stats["decode_steps"]),
        "cpu_experts_per_token": stats["cpu_experts"] / max(1, stats["decode_steps"]),
        "modeled_tpot_ms": stats["modeled_tpot_ms"],
        "measured_tpot_ms": stats["measured_tpot_ms"],
        "tokens": len(nll),
        # two copies: the share of routed uses computed at the low copy, and the high copies reread
        **{k: stats[k] for k in ("low_share", "upgrades") if k in stats},
    }


def _plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(12, 3.4))
    for (tag, rs), color in zip(by_precision(results).items(), ("C0", "C1", "C2", "C3", "C4", "C5")):
        a = [r["alpha"] for r in rs]
        ax[0].plot(a, [r["perplexity"] for r in rs], "o-", color=color, label=tag)
        ax[1].plot(a, [100 * r["agreement"] for r in rs], "o-", color=color, label=f"agreement, {tag}")
        ax[1].plot(a, [100 * r["substitution_rate"] for r in rs], "s--", color=color, label=f"subst., {tag}")
        ax[2].plot(a, [r["modeled_tpot_ms"] for r in rs], "o-", color=color, label=tag)
    ax[0].set_ylabel("perplexity")
    ax[0].legend(fontsize=8, title="experts", title_fontsize=8)
    ax[1].set_ylabel("%")
    ax[1].legend(fontsize=7, title="agreement with model, alpha=0", title_fontsize=7)
    ax[2].set_ylabel("modeled TPOT (ms)")
    for x in ax:
        x.set_xlabel("alpha")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def by_precision(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The sweep's rows by their ``expert_dtype``, in the sweep's order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(r.get("expert_dtype", "model"), []).append(r)
    return groups


def eval_accuracy(
    model: str = "tiny",
    workloads: Sequence[str] = ("sharegpt",),
    alphas: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6),
    policy: str = "smoe",
    capacity: str = "0.25",
    hardware: str | None = None,
    texts: int = 8,
    tokens: int = 96,
    tpot_budget: float | None = None,
    plot: str = "eval-accuracy.png",
    data_dir: str | None = None,
    precisions: Sequence[str] = ("model",),
    group_size: int = 128,
    predictor: str | None = None,
    json: bool = False,
) -> list[dict[str, Any]]:
    """SMoE Table IV-style accuracy sweep over alpha and expert precision: perplexity, agreement with the exact model at alpha = 0, substitution rate, TPOT.

    Every row's perplexity change and greedy next-token agreement are against the model-precision
    experts at alpha = 0. A quantized precision's rows run the model with its experts' weights
    quantized and dequantized in memory (the arithmetic of ``moecast run --offload disk --expert-dtype``);
    their TPOT is the in-memory runtime's, which moves model-dtype experts. Two copies (``mixed``) run the
    live runtime on the disk tier (a temporary offload directory): demand misses compute at the int4 copy,
    prefetched and upgraded experts at the model's; their TPOT is that tier's.

    Args:
        model: ``tiny``, ``tiny:PRESET`` or a local Hugging Face model directory.
        workloads: ``sharegpt`` (held-out conversations) and/or workload names (their prompts).
        alphas: Alphas in [0, 1); 0 is always added (the reference).
        policy: Cache policy: <POLICY_NAMES>.
        capacity: Experts per layer on the device (fraction, count, bytes or ``all``).
        hardware: Hardware profile for the modeled TPOT; default: this machine's (``moecast profile``), else
            prescope-a100-pcie4.
        texts: Held-out texts per workload.
        tokens: Tokens per text (scored token by token, every one a decode step).
        tpot_budget: TPOT budget R in ms: choose alpha by SMoE Eq. 5 (fitted T(alpha), smallest alpha meeting R),
            on the model-precision rows.
        plot: PNG path for the figure ('' for none); one line per precision.
        data_dir: Folder with local datasets for named workloads: <name>/, <name>.jsonl, .json or .parquet
            (as ``moecast collect --data-dir``; no hub download is attempted).
        precisions: Expert precisions to sweep alpha at: model (the model's dtype, exact), int8 (per output
            channel, symmetric), int4 (group-wise, asymmetric, ``--group-size``) and/or two copies: mixed
            (model + int4), int8+int4, model+int8 (high first; the cache decides which computes each use);
            model is always added (the reference).
        group_size: int4's group along each matrix's input dimension: 32, 64, 128 or 256.
        predictor: Layer-ahead predictor checkpoint (LLaPor) the runtime prefetches from under a prefetching
            policy (smoe); default: the online prefetcher (the next layer's gate).
        json: One JSON object per (precision, alpha) (and one for the Eq. 5 choice) instead of a table.
    """
    from moecast.collect.models import load_model

    _threads()
    grid = _alpha_grid(alphas, policy, texts, tokens, tpot_budget, plot)
    precs = _precision_axis(precisions, group_size)
    cap: Any = None if str(capacity).lower() in ("all", "none", "full") else capacity
    pred = _load_predictor(predictor)  # before the model: a wrong path fails at once
    lm, tok, name = load_model(model, dtype="float32")
    _check_model(pred, predictor, lm, name)
    rows = heldout_rows(tok, workloads, texts, tokens, data_dir)
    results = sweep(
        lm, rows, grid, progress=not json, precisions=precs, policy=policy, capacity=cap, hardware=hardware,
        predictor=pred,
    )  # fmt: skip
    choice = _choose(results, tpot_budget)
    _print_sweep(results, choice, name, workloads, rows, policy, capacity, tpot_budget, json)
    if plot:
        _plot(results, Path(plot), f"{name}: accuracy vs alpha ({', '.join(workloads)}, capacity {capacity})")
        if not json:
            print(f"  plot: {plot}")
    if choice is not None:
        if not choice.met:
            raise InputError(choice.message())
        if not json:
            print("  model precision: " + choice.message())
    return results


def _precision_axis(precisions: Sequence[str], group_size: int) -> list[Precision]:
    """``--precisions`` as :class:`Precision` values, the model's first, checked before the model loads."""
    names = [precisions] if isinstance(precisions, str) else list(precisions)  # one name, not its letters
    try:
        return with_reference([expert_setting(n.strip(), group_size) for n in names if n.strip()])
    except InputError as exc:
        raise InputError(f"--precisions {' '.join(names)} --group-size {group_size}: {exc}") from exc


def _choose(results: list[dict[str, Any]], tpot_budget: float | None) -> Any:
    """SMoE Eq. 5's alpha for ``tpot_budget`` on the model-precision rows (None without a budget): the
    quantized rows run the same in-memory runtime, so their TPOT says nothing more about alpha."""
    if tpot_budget is None:
        return None
    from moecast.runtime.core.alpha import choose_alpha

    rs = by_precision(results)["model"]
    return choose_alpha([r["alpha"] for r in rs], [r["modeled_tpot_ms"] for r in rs], tpot_budget)


def _alpha_grid(
    alphas: Sequence[float], policy: str, texts: int, tokens: int, tpot_budget: float | None, plot: str
) -> list[float]:
    """``eval_accuracy``'s alphas, sorted and distinct, once its arguments are checked (before the sweep,
    so that a bad one fails in seconds rather than after it)."""
    grid = sorted({float(a) for a in alphas})
    bad = [a for a in grid if not 0 <= a < 1]
    if bad or not grid:
        raise InputError(f"--alphas {list(alphas)}: every alpha must be in [0, 1)")
    if grid[-1] > 0 and not substitutes(policy):
        raise InputError(
            f"--alphas sweeps substitution, which policy {policy!r} does not use; use --policy smoe"
        )
    if texts < 1 or tokens < 8:
        raise InputError("--texts must be >= 1 and --tokens >= 8")
    if tpot_budget is not None and not (math.isfinite(tpot_budget) and tpot_budget > 0):
        raise InputError(f"--tpot-budget must be a positive number of ms, got {tpot_budget}")
    if plot and (Path(plot).is_dir() or any(p.exists() and not p.is_dir() for p in Path(plot).parents)):
        raise InputError(
            f"--plot {plot}: not a writable file path (a directory, or under a file); choose another"
        )
    return grid


def _print_sweep(
    results: list[dict[str, Any]],
    choice: Any,
    name: str,
    workloads: Sequence[str],
    rows: list[list[int]],
    policy: str,
    capacity: str,
    tpot_budget: float | None,
    json: bool,
) -> None:
    """The sweep as one JSON object per (precision, alpha) (and one for the Eq. 5 choice), or as a table."""
    if json:
        for r in results:
            print(dumps({"model": name, "workloads": list(workloads), **r}))
        if choice is not None:
            print(
                dumps(
                    {
                        "tpot_budget_ms": tpot_budget,
                        "expert_dtype": "model",  # Eq. 5 is fitted on the model-precision rows only
                        "chosen_alpha": choice.alpha,
                        "met": choice.met,
                        "predicted_tpot_ms": choice.predicted_tpot_ms,
                        "fit": choice.coefficients,
                    }
                )
            )
        return
    print(
        f"{name} on {', '.join(workloads)}: {sum(len(r) - 1 for r in rows)} held-out tokens, policy {policy}, capacity {capacity}"
    )
    print("  d ppl and agree (greedy next token) are against the model-precision experts at alpha 0")
    w = max(9, *(len(r["expert_dtype"]) for r in results))  # the widest label: model+int4-g128
    print(
        f"  {'experts':>{w}}  {'alpha':>5}  {'ppl':>8}  {'d ppl':>7}  {'agree':>6}  {'subst':>6}  {'hit':>6}  {'TPOT model':>10}  {'measured':>8}"
    )
    for r in results:
        print(
            f"  {r['expert_dtype']:>{w}}  {r['alpha']:>5.2f}  {r['perplexity']:>8.3f}  {r['ppl_change_pct']:>+6.2f}%  "
            f"{100 * r['agreement']:>5.1f}%  {100 * r['substitution_rate']:>5.1f}%  {100 * r['hit_rate']:>5.1f}%  "
            f"{r['modeled_tpot_ms']:>8.3f}ms  {r['measured_tpot_ms']:>6.2f}ms"
        )
    if len(by_precision(results)) > 1:
        print(
            "  TPOT of the quantized rows: the in-memory runtime's, moving model-dtype experts "
            "(a quantized disk tier's: moecast run --offload disk --expert-dtype); of two copies (A+B): the disk tier's"
        )
    for r in results:
        if r.get("low_share") is not None and r["alpha"] == 0.0:
            print(
                f"  {r['expert_dtype']}: {100 * r['low_share']:.1f}% of the uses at the low copy, {r['upgrades']} upgrades"
            )


# the presets' names and help, from runtime/core/policy.py (jsonargparse reads this docstring)
# the help lists what is registered now: a policy or tier added is in it without an edit here
run.__doc__ = with_policies(run.__doc__ or "", exclude=("belady",)).replace("<TIER_HELP>", tier_help())
eval_accuracy.__doc__ = with_policies(eval_accuracy.__doc__ or "", exclude=("belady",))
