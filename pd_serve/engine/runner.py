"""Runs one batch (the executor's, engine/executor.py): builds the flat batch, runs the model,
samples. Reads the executor's cached requests; never mutates them.

On GPU, batches of one new token per row (decode) replay CUDA graphs captured at bucketed batch
sizes: the batch is padded to the next bucket (padded rows store no KV: slot -1); its token
ids, positions and slots and the attention backend's page table go to a fixed device buffer
in one host->device copy; the graph runs the whole forward, the LM head and the argmax
(kernels/argmax.py, as the Sampler's greedy rows). All buckets share one memory pool. A step
whose rows are all greedy (no logprobs, no penalties) takes its tokens from the graph's argmax;
any other goes through the Sampler.

launch() queues a step and its sampling without waiting for the device; a token still pending
from the step before (CachedRequest.token_at gives -1 - row) is read on the device from that step's
sampled tokens (kernels/pending.py; in the graph, from its fixed token buffer), so the host can
plan step N+1 while step N runs (the overlap schedule).
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from dataclasses import dataclass

import torch

from kernels.argmax import argmax
from kernels.pending import fill_pending_
from pd_serve.engine.attention.base import AttentionBackend, AttentionMetadata
from pd_serve.engine.request import TokenLogprob
from pd_serve.engine.sampler import PendingSample, Sampler, SamplerOutput, score_tokens
from pd_serve.model.llama import CausalLM

logger = logging.getLogger(__name__)
SCORE_ROWS = 256  # prompt-logprob rows at a time: their float32 logits stay ~128 MB at 128k vocabulary


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Captured decode batch sizes: 1, 2, 4, 8, then every multiple of 8, and max_bs itself."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs < max_bs] + list(range(16, max_bs, 8))
    return sorted(set(sizes + [max_bs]))


@dataclass
class BatchChunk:
    """Positions [start, start + num_tokens) of a request (the executor's CachedRequest: token_at,
    all_token_ids, page_ids, sampling_params); sample after them if `sample`."""

    request: object
    start: int
    num_tokens: int
    sample: bool


@dataclass
class Batch:
    chunks: list[BatchChunk]
    # some request of the executor asked for prompt logprobs (else no chunk is looked at for them)
    may_score: bool = True


class ModelRunner:
    def __init__(self, model: CausalLM, attn: AttentionBackend, sampler: Sampler | None, page_size: int):
        """sampler None: compute the logits of the sampling rows but sample nothing (a TP
        follower: the logits all-gather needs every rank)."""
        self.model = model
        self.attn = attn
        self.sampler = sampler
        self.page_size = page_size
        self.device = next(model.parameters()).device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}  # bs -> the graph's output [bs, V]
        # Recorded once a step's host->device input copies are queued; the next launch waits for
        # it before planning, so no host staging buffer (ours or flashinfer's) is rewritten
        # while a copy from it may still be queued behind the step in flight.
        self._inputs_copied: torch.cuda.Event | None = None

    def _flat_batch(self, batch: Batch) -> tuple[torch.Tensor, list[int]]:
        """Token ids, positions and cache slots of every new token (an int64 CPU tensor
        [3, T]), and the rows to sample. Built as Python ints in one array, one tensor at the end:
        small torch ops per chunk cost more host time than a large decode step's device time."""
        ids, positions, slots, sample_rows = array("q"), array("q"), array("q"), []
        page_size = self.page_size
        for chunk in batch.chunks:
            request, start, end = chunk.request, chunk.start, chunk.start + chunk.num_tokens
            ids.extend(chunk_ids(request, start, end))
            positions.extend(range(start, end))
            if end - start == 1:
                slots.append(request.page_ids[start // page_size] * page_size + start % page_size)
            else:
                first = start // page_size
                pages = request.page_ids[first:(end - 1) // page_size + 1]
                page_slots = itertools.chain.from_iterable(
                    range(p * page_size, (p + 1) * page_size) for p in pages)
                slots.extend(itertools.islice(page_slots, start - first * page_size,
                                              end - first * page_size))
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
        ids.extend(positions)
        ids.extend(slots)
        return torch.frombuffer(ids, dtype=torch.int64).view(3, -1), sample_rows

    @staticmethod
    def _metadata(batch: Batch, slot_mapping: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            query_lens=[c.num_tokens for c in batch.chunks],
            seq_lens=[c.start + c.num_tokens for c in batch.chunks],
            page_tables=[c.request.page_ids for c in batch.chunks],
            slot_mapping=slot_mapping,
        )

    def execute(self, batch: Batch, after_layer=None) -> SamplerOutput:
        """Run the batch and wait for its tokens; after_layer(i) is called as layer i finishes
        (eager path only)."""
        pending = self.launch(batch, after_layer)
        if pending.params or pending.prompt_logprobs:
            return pending.result()
        return SamplerOutput(token_ids=[], logprobs=[])

    @torch.inference_mode()
    def launch(self, batch: Batch, after_layer=None,
               prev_tokens: torch.Tensor | None = None) -> PendingSample:
        """Queue the batch and its sampling (no rows when it samples nothing). prev_tokens: the
        sampled tokens of the step still in flight, where this batch's pending inputs are."""
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        graphable = (all(c.num_tokens == 1 for c in batch.chunks) and after_layer is None
                     and not (batch.may_score and any(_scored(c) for c in batch.chunks)))
        if self.graphs and graphable and len(batch.chunks) <= max(self.graphs):
            return self._launch_graph(batch, prev_tokens)
        flat, sample_rows = self._flat_batch(batch)
        pending = bool(flat[0].min() < 0)
        ids, positions, slots = self._to_device(flat)  # one host->device copy
        if pending:
            fill_pending_(ids, _prev(prev_tokens))
        self.attn.plan(self._metadata(batch, slots))
        self._record_inputs_copied()
        hidden = self.model(ids, positions, self.attn, after_layer)  # [T, hidden]
        scored = self._score_prompts(hidden, batch)
        # (a TP follower computes the logits too, and samples nothing: the all-gather needs it)
        logits = (self.model.compute_logits(hidden[self._to_device(torch.tensor(sample_rows))])
                  if sample_rows else None)  # [N, vocab]
        if logits is None or self.sampler is None:
            pending = self._nothing_sampled()
            pending.prompt_logprobs = scored
            return pending
        rows = [c for c in batch.chunks if c.sample]
        return self.sampler.launch(logits, [c.request for c in rows],
                                   [c.start + c.num_tokens for c in rows], scored)

    def _score_prompts(self, hidden: torch.Tensor, batch: Batch) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """The logprobs of the prompt tokens this batch's chunks score (requests that asked for
        prompt logprobs; StepResult.prompt_logprobs' form), from the logits of SCORE_ROWS rows
        at a time, copied to the host at once: such a step waits for its forward. Every rank
        computes the logits (under TP their all-gather needs each); the sampling one keeps them."""
        if not batch.may_score:
            return {}
        spans, rows, targets, offset = [], [], [], 0
        for c in batch.chunks:
            if n := _scored(c):
                spans.append((c.request, c.start, n))
                rows.extend(range(offset, offset + n))
                targets.extend(c.request.all_token_ids[c.start + 1:c.start + 1 + n])
            offset += c.num_tokens
        if not spans:
            return {}
        num_top = max(r.sampling_params.prompt_logprobs for r, _, _ in spans)
        rows_d, targets_d = self._to_device(torch.tensor(rows)), self._to_device(torch.tensor(targets))
        parts = []
        for i in range(0, len(rows), SCORE_ROWS):
            logits = self.model.compute_logits(hidden[rows_d[i:i + SCORE_ROWS]])
            if self.sampler is not None:
                parts.append(score_tokens(logits, targets_d[i:i + SCORE_ROWS], num_top))
        if self.sampler is None:
            return {}
        lps, top_lps, top_ids, ranks = (torch.cat(p).tolist() for p in zip(*parts))
        out, row = {}, 0
        for request, start, n in spans:
            k = request.sampling_params.prompt_logprobs
            out[request.request_id] = (start, [
                TokenLogprob(targets[i], lps[i], list(zip(top_ids[i][:k], top_lps[i][:k])), ranks[i])
                for i in range(row, row + n)])
            row += n
        return out

    # ---- CUDA graphs ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_cuda_graphs(self, max_bs: int, max_pages_per_seq: int) -> None:
        """Capture the decode forward at every graph_batch_sizes(max_bs) size, largest first."""
        start = time.perf_counter()
        sizes = graph_batch_sizes(max_bs)
        self.attn.init_cuda_graph(max_bs, max_pages_per_seq)
        on_cuda = self.device.type == "cuda"  # (CPU: only where a test stands in for _capture)
        # A step's host->device inputs, one int32 buffer copied at once. For bucket bs: token ids
        # [bs], positions [bs], cache slots [bs], then the backend's bs * graph_input_width(bs).
        size = max(bs * (3 + self.attn.graph_input_width(bs)) for bs in sizes)
        self.graph_host = torch.zeros(size, dtype=torch.int32, pin_memory=on_cuda)
        self.graph_device = torch.zeros(size, dtype=torch.int32, device=self.device)
        # The sampled tokens of the step before, where the graph resolves pending ids; the graph
        # then writes its rows' argmax here.
        self.graph_tokens = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        # Every graph writes its logits here: one [max_bs, V] buffer, not one per graph (the
        # graphs' rows together, a 128k vocabulary, would take gigabytes beside the KV cache).
        self.graph_logits_out = torch.empty(max_bs, self.model.config.vocab_size,
                                            dtype=torch.float32, device=self.device)
        pool = torch.cuda.graph_pool_handle() if on_cuda else None
        for bs in reversed(sizes):
            self._plan_graph(bs, [], [], [])  # every row is padding
            self.graphs[bs] = self._capture(bs, pool)
        if on_cuda:
            torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", sizes,
                    time.perf_counter() - start)

    def _capture(self, bs: int, pool) -> torch.cuda.CUDAGraph:
        """Capture the bucket-bs forward into a graph; its output lands in graph_logits[bs] (the
        first bs rows of graph_logits_out)."""
        for _ in range(2):  # compile / autotune outside the capture
            self._graph_forward(bs)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.graph_logits[bs] = self._graph_forward(bs)
        return graph

    def _graph_forward(self, bs: int) -> torch.Tensor:
        ids, positions = self.graph_device[:bs], self.graph_device[bs:2 * bs]
        fill_pending_(ids, self.graph_tokens)
        logits = self.model.compute_logits(self.model(ids, positions, self.attn),
                                           out=self.graph_logits_out[:bs])  # [bs, V] float32
        argmax(logits, out=self.graph_tokens[:bs])
        return logits

    def _plan_graph(self, bs: int, ids: list[int], positions: list[int], slots: list[int],
                    seq_lens: list[int] | None = None, page_tables: list[list[int]] | None = None):
        """Fill the fixed inputs for bucket bs and queue their copy to the device; rows past
        len(ids) are padding (slot -1, a one-token context in page 0)."""
        pad = bs - len(ids)
        host, device = self.graph_host, self.graph_device
        host[:3 * bs] = torch.tensor(ids + [0] * pad + positions + [0] * pad + slots + [-1] * pad,
                                     dtype=torch.int32)
        end = bs * (3 + self.attn.graph_input_width(bs))
        staged = self.attn.plan_cuda_graph(bs, AttentionMetadata(
            query_lens=[1] * bs,
            seq_lens=(seq_lens or []) + [1] * pad,
            page_tables=(page_tables or []) + [[0]] * pad,
            slot_mapping=device[2 * bs:3 * bs],
        ), host[3 * bs:end], device[3 * bs:end])
        end = 3 * bs + staged  # copy what this batch filled, not the bucket's capacity
        device[:end].copy_(host[:end], non_blocking=True)

    def _launch_graph(self, batch: Batch, prev_tokens: torch.Tensor | None) -> PendingSample:
        n = len(batch.chunks)
        bs = min(size for size in self.graphs if size >= n)
        ids, positions, slots, seq_lens = [], [], [], []
        for c in batch.chunks:
            pos = c.start
            ids.append(c.request.token_at(pos))
            positions.append(pos)
            slots.append(c.request.page_ids[pos // self.page_size] * self.page_size + pos % self.page_size)
            seq_lens.append(pos + 1)
        self._plan_graph(bs, ids, positions, slots, seq_lens, [c.request.page_ids for c in batch.chunks])
        if min(ids) < 0:
            prev = _prev(prev_tokens)
            if len(prev) > len(self.graph_tokens):  # an eager step sampled more rows than it holds
                fill_pending_(self.graph_device[:n], prev)
            elif prev.data_ptr() != self.graph_tokens.data_ptr():  # not the graph's own argmax
                self.graph_tokens[:len(prev)].copy_(prev)
        self._record_inputs_copied()
        self.graphs[bs].replay()
        sampled = [c.request for c in batch.chunks if c.sample]
        if not sampled or self.sampler is None:
            return self._nothing_sampled()
        positions = [c.start + 1 for c in batch.chunks if c.sample]
        if len(sampled) == n and self.sampler.argmax_only(sampled, positions):
            return PendingSample(self.graph_tokens[:n], [r.sampling_params for r in sampled])
        logits = self.graph_logits[bs]
        if len(sampled) < bs:
            sample_rows = [i for i, c in enumerate(batch.chunks) if c.sample]
            logits = logits[:n] if len(sampled) == n else logits[torch.tensor(sample_rows, device=self.device)]
        return self.sampler.launch(logits, sampled, positions)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return (_pinned(host) if self.device.type == "cuda" else host).to(self.device, non_blocking=True)

    def _record_inputs_copied(self) -> None:
        if self.device.type == "cuda":
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()

    def _nothing_sampled(self) -> PendingSample:
        return PendingSample(torch.empty(0, dtype=torch.long, device=self.device), [])


def _scored(chunk: BatchChunk) -> int:
    """How many prompt tokens the chunk's logits score: those after each of its positions, up to
    the prompt's last, when the request asked for prompt logprobs (else 0)."""
    request = chunk.request
    if request.sampling_params.prompt_logprobs is None:
        return 0
    return max(0, min(chunk.num_tokens, request.num_prompt_tokens - 1 - chunk.start))


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """A page-locked copy (torch's caching host allocator: a block is reused only once the
    copies queued from it are done), so the host->device copy queues without a wait."""
    return host.pin_memory() if torch.cuda.is_available() else host


def chunk_ids(request, start: int, end: int) -> list[int]:
    """Token ids of positions [start, end); only the last can be pending (negative)."""
    if end - start == 1:
        return [request.token_at(start)]
    ids = request.all_token_ids[start:end]
    if len(ids) < end - start:
        ids.append(request.token_at(end - 1))
    return ids


def _prev(prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """The sampled tokens of the step in flight, which a pending id needs."""
    if prev_tokens is None:
        raise RuntimeError("a planned token is pending but no step is in flight")
    return prev_tokens
