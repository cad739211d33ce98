"""``moecast collect`` and ``moecast traces merge``: plain typed functions wired by moecast/cli.py."""

from __future__ import annotations

import json as jsonlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moecast.collect.traceset import TraceMeta, TraceSet, TraceSetError, TraceWriter, merge

from moecast.errors import InputError

if TYPE_CHECKING:
    from moecast.collect.runner import GenerationSettings

SMALL_HIDDEN = 512  # hidden sizes up to this run single-threaded on CPU unless --threads says otherwise


def _device(device: str) -> str:
    import torch

    if device != "auto":
        return device
    if torch.cuda.is_available():
        # one GPU per torchrun process
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
    return "cpu"


def _probe_norm_topk(model: Any, tokenizer: Any, recorder: Any) -> bool:
    """Whether the routing weights the model uses sum to one (for configs without ``norm_topk_prob``)."""
    import torch

    ids = tokenizer("The quick brown fox", return_tensors="pt")["input_ids"].to(
        next(model.parameters()).device
    )
    with torch.no_grad():
        model(input_ids=ids)
    sums = recorder.take().topk_weights.sum(-1)
    return bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-3))


def collect(
    model: str = "tiny",
    workloads: Sequence[str] = ("sharegpt",),
    out: str | None = None,
    max_requests: int | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    max_prompt_tokens: int = 1024,
    chunk_size: int = 32,
    chat_template: bool = False,
    data_dir: str | None = None,
    gate_inputs: bool = False,
    router_probs: bool = True,
    router_pattern: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    num_shards: int | None = None,
    shard_index: int | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    threads: int | None = None,
    progress: bool = True,
    json: bool = False,
) -> Path:
    """Record where an MoE model's router sends every token of a set of workloads, into a TraceSet.

    Prefill records every prompt token, then greedy decoding records every generated
    token (EOS excluded). Re-running the same command resumes: requests already
    stored are skipped. Shards (``--num-shards``/``--shard-index``, default from
    torchrun's WORLD_SIZE/RANK) may share one --out or write separate ones joined
    with ``moecast traces merge``.

    Args:
        model: ``tiny`` (the embedded model; ``tiny:PRESET`` for another preset) or a local Hugging Face MoE model directory.
        workloads: Workload names (configs/workloads: gsm8k, boolq, race-middle, wic, triviaqa, gaokao, sharegpt) or spec .yaml paths.
        out: Output TraceSet directory (default: traces/<model>-<workloads>).
        max_requests: Requests per workload (default: every row).
        max_new_tokens: Greedy decode length limit per request.
        batch_size: Requests per forward batch (left-padded).
        max_prompt_tokens: Prompts are truncated to this many tokens.
        chunk_size: Requests per written part (a kill loses at most one chunk).
        chat_template: Wrap each prompt as one user turn with the tokenizer's chat template (instruct models).
        data_dir: Folder with local datasets: <name>/, <name>.jsonl, .json or .parquet.
        gate_inputs: Also record each router's input hidden state (float16 [L, H] per token).
        router_probs: Record the full router probability vector (float16 [L, E] per token).
        router_pattern: Regex over module names of the routers, for models outside transformers' experts interface.
        dtype: Model dtype: auto (as saved), float32, bfloat16, float16.
        device: auto (GPU LOCAL_RANK when CUDA is present, else cpu), cpu, cuda:0, ...
        num_shards: Split the requests over this many processes (default: $WORLD_SIZE or 1).
        shard_index: This process's shard (default: $RANK or 0).
        seed: Torch seed (greedy decoding is deterministic; recorded in meta.json).
        trust_remote_code: Allow model code from the model directory.
        threads: torch CPU threads for this run (default: 1 for small models on CPU, else torch's choice).
        progress: Show a progress bar.
        json: Print the summary as one JSON object per line.
    """
    import torch
    from moecast.collect.runner import Collector

    settings = _settings(
        max_requests, max_new_tokens, batch_size, max_prompt_tokens, chunk_size, chat_template
    )
    # Everything that can fail on bad input is checked before the model loads and anything is written.
    specs, mine, num_shards, shard_index = _my_requests(
        workloads, data_dir, max_requests, num_shards, shard_index
    )
    torch.manual_seed(seed)
    previous_threads = _set_threads(threads)
    lm, tokenizer, name, structure, info = _load(
        model, dtype, device, trust_remote_code, router_pattern, threads
    )
    recorder, want_probs = _recorder(structure, info, router_probs, gate_inputs)
    out_path = Path(out) if out else _default_out(name, specs)
    try:
        recorder.attach(lm)
        if structure.pattern is None and not hasattr(lm.config, "norm_topk_prob"):
            info.norm_topk_prob = _probe_norm_topk(lm, tokenizer, recorder)
        dtype_name = str(next(lm.parameters()).dtype).replace("torch.", "")
        collection = _collection_meta(
            out_path, specs, settings, max_requests, seed, dtype_name, structure, want_probs, num_shards
        )
        fields = {"topk_weights": True, "router_probs": want_probs, "gate_inputs": gate_inputs}
        writer = TraceWriter(
            out_path, TraceMeta(model=info, collection=collection, fields=fields), shard=shard_index
        )
        collector = Collector(lm, tokenizer, recorder, settings)
        _, stats = collector.run(mine, writer, progress=progress)
    finally:
        recorder.detach()
        torch.set_num_threads(previous_threads)
    _summary(out_path, specs, stats, shard_index, num_shards, json)
    return out_path


def _settings(
    max_requests: int | None,
    max_new_tokens: int,
    batch_size: int,
    max_prompt_tokens: int,
    chunk_size: int,
    chat_template: bool,
) -> GenerationSettings:
    """The run's checked generation settings (--max-requests is checked here too)."""
    from moecast.collect.runner import GenerationSettings

    if max_requests is not None and max_requests < 1:
        raise InputError(
            f"--max-requests must be at least 1 (got {max_requests}); leave it out to use every row"
        )
    return GenerationSettings(
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        max_prompt_tokens=max_prompt_tokens,
        chunk_size=chunk_size,
        chat_template=chat_template,
    )


def _my_requests(
    workloads: Sequence[str],
    data_dir: str | None,
    max_requests: int | None,
    num_shards: int | None,
    shard_index: int | None,
) -> tuple[list[Any], list[Any], int, int]:
    """(workload specs, this shard's requests, num_shards, shard_index), shards defaulting to torchrun's."""
    from moecast.collect.runner import default_shard, shard_requests
    from moecast.collect.workloads import load_requests, parse_workloads

    env_shards, env_index = default_shard()
    num_shards = env_shards if num_shards is None else num_shards
    shard_index = env_index if shard_index is None else shard_index
    specs = parse_workloads(workloads)
    requests = [r for spec in specs for r in load_requests(spec, data_dir, max_requests)]
    return specs, shard_requests(requests, num_shards, shard_index), num_shards, shard_index


def _set_threads(threads: int | None) -> int:
    """Apply --threads to torch; returns torch's thread count before, to restore after the run."""
    import torch

    previous_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise InputError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return previous_threads


def _load(
    model: str,
    dtype: str,
    device: str,
    trust_remote_code: bool,
    router_pattern: str | None,
    threads: int | None,
) -> tuple[Any, Any, str, Any, Any]:
    """(model, tokenizer, name, MoE structure, model info) of the model to collect from."""
    import torch
    from moecast.collect.models import find_moe_structure, load_model, model_info

    lm, tokenizer, name = load_model(
        model, dtype=dtype, device=_device(device), trust_remote_code=trust_remote_code
    )
    structure = find_moe_structure(lm, router_pattern)
    info = model_info(lm, structure, name)
    if threads is None and info.hidden_size <= SMALL_HIDDEN and next(lm.parameters()).device.type == "cpu":
        # Matrices this small finish before a second thread is scheduled; on a loaded machine
        # intra-op threading made `tiny` 10-40x slower, so small CPU models run single-threaded.
        torch.set_num_threads(1)
    return lm, tokenizer, name, structure, info


def _recorder(structure: Any, info: Any, router_probs: bool, gate_inputs: bool) -> tuple[Any, bool]:
    """(routing recorder, whether it records router probabilities) for the model's MoE layers."""
    from moecast.collect.recorder import RoutingRecorder

    want_probs = router_probs and (
        structure.pattern is not None or all(e.router is not None for e in structure.layers)
    )
    recorder = RoutingRecorder(
        structure,
        info.top_k,
        router_probs=want_probs,
        gate_inputs=gate_inputs,
        norm_topk_prob=info.norm_topk_prob,
    )
    return recorder, want_probs


def _default_out(name: str, specs: list[Any]) -> Path:
    """traces/<model>-<workloads>: where a run without --out writes."""
    return Path("traces") / f"{Path(name).name.replace(':', '-')}-{'-'.join(s.name for s in specs)}"


def _collection_meta(
    out_path: Path,
    specs: list[Any],
    settings: GenerationSettings,
    max_requests: int | None,
    seed: int,
    dtype_name: str,
    structure: Any,
    want_probs: bool,
    num_shards: int,
) -> dict[str, Any]:
    """The TraceSet's ``collection`` record (meta.json); a resumed or sharded run keeps the earlier
    runs' workloads and must have their generation settings."""
    from moecast import __version__

    collection: dict[str, Any] = {
        "source": "moecast collect",
        "workloads": [s.name for s in specs],
        "categories": {s.name: s.category for s in specs},
        "generation": {
            "max_new_tokens": settings.max_new_tokens,
            "greedy": True,
            "batch_size": settings.batch_size,
            "max_prompt_tokens": settings.max_prompt_tokens,
            "max_requests_per_workload": max_requests,
            "chat_template": settings.chat_template,
        },
        "seed": seed,
        "dtype": dtype_name,
        "tool_version": __version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "router_probs_kind": structure.router_probs_kind if want_probs else None,
        "routing_source": "experts-interface"
        if structure.pattern is None
        else f"router-pattern {structure.pattern}",
        "num_shards": num_shards,
    }
    meta_path = out_path / "meta.json"
    if meta_path.exists():
        # a resumed or sharded run adds workloads; it does not forget earlier ones
        try:
            old = jsonlib.loads(meta_path.read_text()).get("collection", {})
        except ValueError:
            old = {}
        _same_settings(out_path, old, collection)
        collection["workloads"] = list(dict.fromkeys([*old.get("workloads", []), *collection["workloads"]]))
        collection["categories"] = {**old.get("categories", {}), **collection["categories"]}
    return collection


# what makes two runs' tokens comparable; batch size and request counts only change how many there are
_SAME_SETTINGS = ("max_new_tokens", "greedy", "max_prompt_tokens", "chat_template")


def _same_settings(out: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Refuse to resume (or add a shard to) a TraceSet collected with other generation settings or
    another dtype: its meta.json could describe only one of the two runs."""
    og, ng = old.get("generation") or {}, new.get("generation") or {}
    diff = [
        f"{k} {og.get(k)!r} -> {ng.get(k)!r}" for k in _SAME_SETTINGS if k in og and og.get(k) != ng.get(k)
    ]
    if old.get("dtype") and old.get("dtype") != new.get("dtype"):
        diff.append(f"dtype {old.get('dtype')!r} -> {new.get('dtype')!r}")
    if diff:
        raise TraceSetError(
            f"{out} was collected with other settings ({'; '.join(diff)}); rerun with the same options "
            "to resume it, or collect into another --out"
        )


def _summary(
    out: Path, specs: list[Any], stats: dict[str, float], shard: int, shards: int, as_json: bool
) -> None:
    ts = TraceSet(out)
    per = _per_workload(ts, specs)
    run = {
        "out": str(out),
        "shard": shard,
        "num_shards": shards,
        "collected": int(stats["requests"]),
        "skipped_existing": int(stats["skipped"]),
        "tokens": int(stats["tokens"]),
        "seconds": round(stats["seconds"], 2),
        "tokens_per_s": round(stats["tokens_per_s"], 1),
        "total_requests": ts.num_requests,
        "total_tokens": ts.num_tokens,
    }
    if as_json:
        print(jsonlib.dumps(run))
        for name, e in per.items():
            acc = e["correct"] / e["scored"] if e["scored"] else None
            print(jsonlib.dumps({"workload": name, **e, "accuracy": acc}))
        return
    _print_summary(out, run, per, shard, shards)


def _per_workload(ts: TraceSet, specs: list[Any]) -> dict[str, dict[str, Any]]:
    """Requests, tokens and (where the workload scores answers) correct answers per workload."""
    by_name = {s.name: s for s in specs}
    per: dict[str, dict[str, Any]] = {}
    for rid in ts.request_ids:
        row = ts.request_info(rid)
        entry = per.setdefault(row["workload"], {"requests": 0, "tokens": 0, "correct": 0, "scored": 0})
        entry["requests"] += 1
        entry["tokens"] += row["num_prompt_tokens"] + row["num_generated_tokens"]
        spec = by_name.get(row["workload"])
        verdict = spec.correct(row["output_text"], row["reference"]) if spec else None
        if verdict is not None:
            entry["scored"] += 1
            entry["correct"] += int(verdict)
    return per


def _print_summary(
    out: Path, run: dict[str, Any], per: dict[str, dict[str, Any]], shard: int, shards: int
) -> None:
    """The collection summary as text: this run, the TraceSet's totals, then a row per workload."""
    print(
        f"collected {run['collected']} requests ({run['skipped_existing']} already stored) -> {out}"
        f"  [shard {shard}/{shards}]"
    )
    print(
        f"  {run['tokens']:,} tokens in {run['seconds']:.1f} s ({run['tokens_per_s']:.0f} tok/s); "
        f"trace set now {run['total_requests']} requests, {run['total_tokens']:,} tokens"
    )
    print(f"  {'workload':<14} {'requests':>8} {'tokens':>9} {'accuracy':>9}")
    for name, e in per.items():
        acc = f"{e['correct'] / e['scored']:.3f}" if e["scored"] else "-"
        print(f"  {name:<14} {e['requests']:>8} {e['tokens']:>9,} {acc:>9}")


def merge_traces(sources: list[str], out: str | None = None, json: bool = False) -> Path:
    """Merge TraceSets of one model (e.g. collection shards) into --out; each request is stored once.

    Args:
        sources: TraceSet directories to merge.
        out: Output TraceSet directory (created, or extended when it already holds the same model's traces).
        json: Print the summary as one JSON object.
    """
    if not sources or not out:
        raise TraceSetError("name the TraceSets and the output: moecast traces merge A B --out C")
    out_path = Path(out)
    if any(Path(s).resolve() == out_path.resolve() for s in sources):
        raise TraceSetError(f"--out {out} is also a source; merge into a new directory")
    ts = merge(sources, out_path)  # checks an existing --out against the sources before writing
    summary = {
        "out": str(out_path),
        "sources": len(sources),
        "requests": ts.num_requests,
        "tokens": ts.num_tokens,
    }
    if json:
        print(jsonlib.dumps(summary))
    else:
        print(
            f"merged {len(sources)} trace sets -> {out_path}: {ts.num_requests} requests, {ts.num_tokens:,} tokens"
        )
    return out_path
