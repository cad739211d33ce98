"""Batched greedy generation that records every token's routing into a TraceSet.

Requests are batched with left padding and an attention mask; position ids come
from the mask, so a request's computation does not depend on its batch-mates
beyond float rounding. The prefill records every prompt token; each greedy
decode step then feeds back the token just generated and records it, until EOS
(which is not fed back, so not recorded) or ``max_new_tokens`` generated tokens.
Padded positions and requests that have finished are never recorded.

Results go to a :class:`~moecast.collect.traceset.TraceWriter` one chunk of
requests at a time (each chunk one atomic part), so a kill loses at most the
chunk in flight and a re-run skips every request already stored.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from moecast.collect.models import kv_cache, with_cache
from moecast.collect.recorder import RoutingRecorder
from moecast.collect.traceset import RequestRecord, TraceWriter
from moecast.collect.workloads import WorkloadRequest

from moecast.errors import InputError


@dataclass
class GenerationSettings:
    """How requests are generated (stored in meta.json's collection section)."""

    max_new_tokens: int = 32
    batch_size: int = 8
    max_prompt_tokens: int = 1024
    chunk_size: int = 32  # requests per written part
    greedy: bool = True
    chat_template: bool = False  # wrap each prompt as one user turn with the tokenizer's chat template

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise InputError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_prompt_tokens < 1:
            raise InputError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.chunk_size < 1:
            raise InputError(f"--chunk-size must be >= 1, got {self.chunk_size}")


@dataclass
class _Pending:
    """Per-request buffers while its batch runs."""

    token_ids: list[int]
    phases: list[bool]
    ids: list[np.ndarray] = field(default_factory=list)
    weights: list[np.ndarray] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)
    gates: list[np.ndarray] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


def shard_requests(
    requests: Sequence[WorkloadRequest], num_shards: int, shard_index: int
) -> list[WorkloadRequest]:
    """Deterministic round-robin split by position in the request list (same list, same split)."""
    if num_shards < 1:
        raise InputError(f"--num-shards must be >= 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise InputError(f"--shard-index must be in [0, {num_shards}), got {shard_index}")
    return list(requests[shard_index::num_shards])


def default_shard() -> tuple[int, int]:
    """(num_shards, shard_index) from torchrun's WORLD_SIZE / RANK, else (1, 0)."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}


def pad_id(tokenizer: Any) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if value is not None:
            return int(value)
    return 0


class Collector:
    """Runs batches of requests through a model with a recorder attached and builds RequestRecords.

    With ``recorder=None`` the same generation runs untraced (records carry no routing);
    bench/bench_collect.py uses it to measure the recorder's overhead.
    """

    def __init__(
        self, model: Any, tokenizer: Any, recorder: RoutingRecorder | None, settings: GenerationSettings
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.recorder = recorder
        self.settings = settings
        self.device = next(model.parameters()).device
        self.eos = eos_ids(model, tokenizer)
        self.pad = pad_id(tokenizer)
        self.tokens_done = 0

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        texts, special = list(prompts), True
        if self.settings.chat_template:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InputError(
                    "this model's tokenizer has no chat template; collect without --chat-template"
                )
            texts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in prompts
            ]
            special = False  # the template already holds BOS and role markers
        encoded = self.tokenizer(
            texts, add_special_tokens=special, truncation=True, max_length=self.settings.max_prompt_tokens
        )["input_ids"]
        out = []
        for prompt, ids in zip(prompts, encoded):
            if not ids:
                raise InputError(f"prompt {prompt[:40]!r} tokenises to nothing; drop it from the workload")
            out.append(list(ids))
        return out

    def _keep(self, pending: list[_Pending], rows: list[tuple[int, int]], width: int) -> None:
        if self.recorder is not None:
            self._store(pending, rows, self.recorder.take(), width)
        else:
            self.tokens_done += sum(width - start for _, start in rows)

    def _store(self, pending: list[_Pending], rows: list[tuple[int, int]], routing: Any, width: int) -> None:
        """Copy the routing of (request, position-in-step) pairs out of one forward's [B*S, L, ...] tensors."""
        B = len(pending)
        ids = routing.topk_ids.to(torch.int16).cpu().numpy().reshape(B, width, *routing.topk_ids.shape[1:])
        weights = (
            routing.topk_weights.to(torch.float16)
            .cpu()
            .numpy()
            .reshape(B, width, *routing.topk_weights.shape[1:])
        )
        probs = gates = None
        if routing.router_probs is not None:
            probs = (
                routing.router_probs.to(torch.float16)
                .cpu()
                .numpy()
                .reshape(B, width, *routing.router_probs.shape[1:])
            )
        if routing.gate_inputs is not None:
            gates = (
                routing.gate_inputs.to(torch.float16)
                .cpu()
                .numpy()
                .reshape(B, width, *routing.gate_inputs.shape[1:])
            )
        for b, start in rows:
            p = pending[b]
            p.ids.append(ids[b, start:])
            p.weights.append(weights[b, start:])
            if probs is not None:
                p.probs.append(probs[b, start:])
            if gates is not None:
                p.gates.append(gates[b, start:])
            self.tokens_done += width - start

    @torch.no_grad()
    def run_batch(self, requests: Sequence[WorkloadRequest]) -> list[RequestRecord]:
        """Prefill + greedy decode one batch; one RequestRecord per request, in order."""
        prompts = self.encode([r.prompt for r in requests])
        B, P = len(prompts), max(len(p) for p in prompts)
        input_ids, mask = self._left_padded(prompts, P)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        pending = [_Pending(token_ids=list(ids), phases=[False] * len(ids)) for ids in prompts]
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True)
        self._keep(pending, [(b, P - len(ids)) for b, ids in enumerate(prompts)], P)
        cache = kv_cache(out)
        next_tok = out.logits[:, -1].argmax(-1)
        last_pos = position[:, -1]
        finished = [False] * B
        for _step in range(self.settings.max_new_tokens):
            active = self._accept(next_tok.tolist(), finished, pending)
            if not active:
                break
            # Finished rows still ride along (rebuilding the KV cache without them costs more than
            # their one token); their records are simply not kept.
            feed = torch.where(torch.tensor(finished, device=self.device), self.pad, next_tok)[:, None]
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            out = self.model(
                input_ids=feed,
                attention_mask=mask,
                position_ids=last_pos[:, None],
                **with_cache(self.model, cache),
                use_cache=True,
            )
            cache = kv_cache(out)
            self._keep(pending, [(b, 0) for b in active], 1)
            next_tok = out.logits[:, -1].argmax(-1)
        return [self._record(req, p) for req, p in zip(requests, pending)]

    def _left_padded(self, prompts: list[list[int]], P: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``prompts`` left-padded to ``P`` tokens and their attention mask, on the model's device."""
        B = len(prompts)
        input_ids = torch.full((B, P), self.pad, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for b, ids in enumerate(prompts):
            input_ids[b, P - len(ids) :] = torch.tensor(ids)
            mask[b, P - len(ids) :] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def _accept(self, chosen: list[int], finished: list[bool], pending: list[_Pending]) -> list[int]:
        """Append each unfinished request's chosen token (EOS finishes it instead); the rows still active."""
        active = []
        for b in range(len(chosen)):
            if finished[b]:
                continue
            if chosen[b] in self.eos:
                finished[b] = True
                continue
            pending[b].generated.append(chosen[b])
            pending[b].token_ids.append(chosen[b])
            pending[b].phases.append(True)
            active.append(b)
        return active

    def _record(self, req: WorkloadRequest, p: _Pending) -> RequestRecord:
        texts = self.tokenizer.batch_decode([[t] for t in p.token_ids])
        return RequestRecord(
            request_id=req.request_id,
            workload=req.workload,
            category=req.category,
            prompt=req.prompt,
            token_ids=np.asarray(p.token_ids, dtype=np.int64),
            token_texts=list(texts),
            phases=np.asarray(p.phases, dtype=bool),
            topk_ids=np.concatenate(p.ids) if p.ids else np.zeros((len(p.token_ids), 0, 0), dtype=np.int16),
            topk_weights=np.concatenate(p.weights) if p.weights else None,
            router_probs=np.concatenate(p.probs) if p.probs else None,
            gate_inputs=np.concatenate(p.gates) if p.gates else None,
            reference=req.reference,
            output_text=self.tokenizer.decode(p.generated, skip_special_tokens=True),
        )

    def run(
        self, requests: Sequence[WorkloadRequest], writer: TraceWriter | None = None, progress: bool = True
    ) -> tuple[list[RequestRecord], dict[str, float]]:
        """Collect every request not yet in ``writer.done``; write chunk by chunk. Returns (records, stats).

        Without a writer the records are returned (tests, benchmarks); with one they
        are written and only the stats come back.
        """
        from tqdm.auto import tqdm

        todo = [r for r in requests if writer is None or r.request_id not in writer.done]
        skipped = len(requests) - len(todo)
        records: list[RequestRecord] = []
        bar = tqdm(total=len(todo), desc="collect", unit="req", disable=not progress)
        started = time.perf_counter()
        self.tokens_done = 0
        size = self.settings.chunk_size
        try:
            for c in range(0, len(todo), size):
                chunk = todo[c : c + size]
                # Similar lengths batched together waste less compute on padding.
                order = sorted(range(len(chunk)), key=lambda i: len(chunk[i].prompt))
                done: dict[int, RequestRecord] = {}
                for b in range(0, len(order), self.settings.batch_size):
                    idx = order[b : b + self.settings.batch_size]
                    for i, rec in zip(idx, self.run_batch([chunk[i] for i in idx])):
                        done[i] = rec
                    bar.update(len(idx))
                    elapsed = time.perf_counter() - started
                    bar.set_postfix(tok_s=f"{self.tokens_done / max(elapsed, 1e-9):.0f}")
                ordered = [done[i] for i in range(len(chunk))]
                if writer is not None:
                    writer.write(ordered)
                else:
                    records.extend(ordered)
        finally:
            bar.close()
        elapsed = time.perf_counter() - started
        stats = {
            "requests": len(todo),
            "skipped": skipped,
            "tokens": self.tokens_done,
            "seconds": elapsed,
            "tokens_per_s": self.tokens_done / elapsed if elapsed > 0 else 0.0,
        }
        return records, stats
