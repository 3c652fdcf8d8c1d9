"""Executes a scheduler plan: builds the flat batch, runs the model, samples. Never mutates requests."""

from __future__ import annotations

import torch

from pd_serve.engine.attention.base import AttentionBackend, AttentionMetadata
from pd_serve.engine.sampler import Sampler, SamplerOutput
from pd_serve.engine.scheduler import SchedulerOutput
from pd_serve.model.llama import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, attn: AttentionBackend, sampler: Sampler, page_size: int):
        self.model = model
        self.attn = attn
        self.sampler = sampler
        self.page_size = page_size
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> SamplerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for chunk in plan.chunks:
            request, end = chunk.request, chunk.start + chunk.num_tokens
            input_ids += request.all_token_ids[chunk.start:end]
            for pos in range(chunk.start, end):
                positions.append(pos)
                slots.append(request.page_ids[pos // self.page_size] * self.page_size
                             + pos % self.page_size)
            if chunk.sample:
                sample_rows.append(len(input_ids) - 1)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        self.attn.plan(AttentionMetadata(
            query_lens=[c.num_tokens for c in plan.chunks],
            seq_lens=[c.start + c.num_tokens for c in plan.chunks],
            page_tables=[c.request.page_ids for c in plan.chunks],
            slot_mapping=as_tensor(slots),
        ))
        hidden = self.model(as_tensor(input_ids), as_tensor(positions), self.attn)  # [T, hidden]
        if not sample_rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = self.model.compute_logits(hidden[as_tensor(sample_rows)])  # [N, vocab]
        return self.sampler(logits, [c.request for c in plan.chunks if c.sample])
