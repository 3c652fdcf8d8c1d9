"""Discrete-event simulation of a pd-serve cluster under a workload, on a fitted CostModel.

It follows what the real workers do (gateway/cluster.py, prefill/ and decode/worker.py, the
engine's Scheduler), one event at a time:
  disaggregated (x prefill + y decode workers)
    arrival -> a decode worker admits it (a slot of --max-running-requests, held until the
    request ends; when every worker is full the request waits, FIFO, at the gateway; the decode
    worker answers between its steps, so a busy one answers when its step ends) -> the
    least-loaded prefill worker queues it -> prefill steps (FCFS, running prompts first, then
    waiting ones while the --chunked-prefill-size token budget and --max-running-requests allow)
    -> token 1 at the end of the step that completes the prompt -> the KV transfer (one at a
    time per prefill worker: one I/O thread) -> token 1 reaches the client and the request
    joins the decode worker's batch at its next step -> one token per step until output_len.
  colocated (K workers): the least-loaded worker runs the same scheduler with decodes and
    prompt chunks in one step; token 1 at the end of the step that completes the prompt.
Steps run back to back while a worker has work. Step time: CostModel.step_time with the
step's prompt tokens, their attention pairs, the decode batch and its mean cached context.
Where the cost model has a pipeline (a GPU profile, whose engine runs the overlap schedule),
colocated workers run that schedule instead: the host plans and launches step N (its host
time), then waits for step N-1, whose tokens reach the client then; the device runs step N after
N-1 and no sooner than its launch allows (start of the launch + max(host, device)). So the eager
launches of a step of a few prompt tokens hide behind a long step before it. Prefill workers
(they report finished layers, so every step is whole) and decode workers (decode-only steps,
profiled at their back-to-back period) keep whole steps.
Not modelled: KV-cache capacity (no preemption), gateway and network message latency (beyond
the transfer's latency_s), the gateway's 20 ms admission retry, request timeouts.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pd_serve.planner.costs import CostModel, attn_pairs
from pd_serve.planner.metrics import RequestRecord, compute_metrics


@dataclass(frozen=True)
class PoolLimits:
    """The batch limits of one pool's workers (their --max-running-requests, --chunked-prefill-size)."""

    max_running_requests: int = 256
    chunked_prefill_size: int = 2048  # -1: no chunking (every prompt whole)


@dataclass(frozen=True)
class ClusterSpec:
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    prefill: PoolLimits = PoolLimits()
    decode: PoolLimits = PoolLimits()
    colocated: PoolLimits = PoolLimits()

    def __post_init__(self) -> None:
        if not (self.num_prefill and self.num_decode) and not self.num_colocated:
            raise ValueError("a cluster needs a prefill and a decode worker, or a colocated one")
        if (self.num_prefill or self.num_decode) and self.num_colocated:
            raise ValueError("a cluster is disaggregated or colocated, not both")

    @property
    def name(self) -> str:
        """As bench/phase_ratio.py names it: 1p1d, colocated2."""
        if self.num_colocated:
            return f"colocated{self.num_colocated}"
        return f"{self.num_prefill}p{self.num_decode}d"


@dataclass(eq=False)
class SimRequest:
    arrival: float
    input_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)  # when each token reached the client
    num_computed: int = 0  # prompt tokens computed
    num_sampled: int = 0  # tokens sampled (token_times lags it by the transfer)

    @property
    def context(self) -> int:
        """Tokens in the KV cache before this request's next decode step."""
        return self.input_len + self.num_sampled - 1


class _Worker:
    """One engine: the Scheduler's plan (running first, then waiting, under a token budget)."""

    def __init__(self, sim: "Simulation", limits: PoolLimits, on_prompt_done, pipelined: bool = False):
        self.sim, self.limits, self.on_prompt_done = sim, limits, on_prompt_done
        self.pipelined = pipelined  # the overlap schedule (module docstring)
        self.in_flight = None  # pipelined: (what it samples, device end) of the last launched step
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.busy = False
        self.step_end = 0.0  # when the step in progress ends (its messages are read then)
        self.load = 0  # outstanding tokens, as the gateway's least_load router counts them
        self.num_admitted = 0  # decode: requests holding a slot (admitted, not yet finished)
        self.link_free_at = 0.0  # prefill: when its KV sender is done with earlier transfers

    def add(self, request: SimRequest, running: bool = False) -> None:
        (self.running if running else self.waiting).append(request)
        self.kick()

    def kick(self) -> None:
        """Start a step once the events of this instant are in (the worker reads every queued
        message before it steps)."""
        if not self.busy:
            self.busy = True
            self.sim.at(self.sim.now, self._iterate if self.pipelined else self._start_step)

    def _start_step(self) -> None:
        chunks = self._schedule()
        if chunks:
            self.step_end = self.sim.now + self.sim.costs.step_time(*self._shape(chunks))
            self.sim.at(self.step_end, self._step_done, chunks)
        else:
            self.busy = False

    def _step_done(self, chunks) -> None:
        self._deliver(self._advance(chunks))
        self.busy = False
        self.kick()

    def _iterate(self) -> None:
        """One turn of the overlap schedule: plan and launch a step, then wait for the one
        launched before it and deliver its tokens."""
        chunks = self._schedule()
        previous, self.in_flight = self.in_flight, None
        launched = self.sim.now
        if chunks:
            host, device = self.sim.costs.pipelined_step(*self._shape(chunks))
            end = self.sim.now + max(host, device)
            if previous is not None:
                end = max(end, previous[1] + device)
            self.in_flight = (self._advance(chunks), end)
            launched += host
        if previous is not None:
            self.sim.at(max(launched, previous[1]), self._settle, previous[0])
        elif chunks:
            self.sim.at(launched, self._iterate)
        else:
            self.busy = False

    def _settle(self, sampled) -> None:
        self._deliver(sampled)
        self._iterate()

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        size = self.limits.chunked_prefill_size
        budget = size if size > 0 else 1 << 62
        chunks = []
        for r in self.running:
            if budget == 0:
                break
            if r.num_sampled >= r.output_len:  # its last token is in flight (pipelined)
                continue
            n = min(r.input_len - r.num_computed, budget) if r.num_computed < r.input_len else 1
            chunks.append((r, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_running_requests:
            r = self.waiting.pop(0)
            self.running.append(r)
            n = min(r.input_len - r.num_computed, budget)
            chunks.append((r, n))
            budget -= n
        return chunks

    def _shape(self, chunks) -> tuple[int, int, int, float]:
        """What a step costs by: prompt tokens, their attention pairs, decode batch and context."""
        prompt_rows = [(n, r.num_computed + n) for r, n in chunks if r.num_computed < r.input_len]
        decodes = [r for r, _ in chunks if r.num_computed >= r.input_len]
        context = sum(r.context for r in decodes) / len(decodes) if decodes else 0.0
        return sum(n for n, _ in prompt_rows), attn_pairs(prompt_rows), len(decodes), context

    def _advance(self, chunks) -> list[tuple[SimRequest, bool]]:
        """The step's effect on its requests; returns those it samples a token for (True: the
        prompt's first)."""
        sampled = []
        for r, n in chunks:
            if r.num_computed < r.input_len:
                r.num_computed += n
                if r.num_computed == r.input_len:
                    r.num_sampled = 1
                    sampled.append((r, True))
            else:
                r.num_sampled += 1
                sampled.append((r, False))
        return sampled

    def _deliver(self, sampled) -> None:
        """The sampled tokens reach the client now."""
        for r, first in sampled:
            if first:
                self.on_prompt_done(self, r)
                continue
            r.token_times.append(self.sim.now)
            if len(r.token_times) == r.output_len:
                self.running.remove(r)
                self.sim.finish(self, r)


class Simulation:
    def __init__(self, spec: ClusterSpec, costs: CostModel):
        self.spec, self.costs = spec, costs
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.prefill = [_Worker(self, spec.prefill, self._prefilled) for _ in range(spec.num_prefill)]
        self.decode = [_Worker(self, spec.decode, None) for _ in range(spec.num_decode)]
        self.colocated = [_Worker(self, spec.colocated, self._first_token, costs.pipeline is not None)
                          for _ in range(spec.num_colocated)]
        self.admit_queue: list[SimRequest] = []
        self.slots: dict[int, _Worker] = {}  # id(request) -> the decode worker that admitted it

    def at(self, time: float, fn, *args) -> None:
        heapq.heappush(self._events, (time, next(self._seq), fn, args))

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        for r in requests:
            self.at(r.arrival, self._arrive, r)
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        return requests

    # ---- the gateway ------------------------------------------------------------------------
    def _arrive(self, r: SimRequest) -> None:
        if self.colocated:
            worker = _least_loaded(self.colocated)
            worker.load += r.input_len + r.output_len
            worker.add(r)
        else:
            self.admit_queue.append(r)
            self._admit()

    def _admit(self) -> None:
        """Decode admission first (a slot per request), then the prompt goes to prefill."""
        while self.admit_queue:
            free = [d for d in self.decode if d.num_admitted < d.limits.max_running_requests]
            if not free:
                return
            r = self.admit_queue.pop(0)
            decode = _least_loaded(free)
            decode.load += r.input_len + r.output_len
            decode.num_admitted += 1
            self.slots[id(r)] = decode
            self.at(max(self.now, decode.step_end), self._to_prefill, r)

    def _to_prefill(self, r: SimRequest) -> None:
        """The decode worker's answer is in: the least-loaded prefill worker queues the prompt."""
        prefill = _least_loaded(self.prefill)
        prefill.load += r.input_len
        prefill.add(r)

    # ---- worker callbacks ---------------------------------------------------------------------
    def _prefilled(self, worker: _Worker, r: SimRequest) -> None:
        """Token 1 is sampled: detach the request and queue its KV on this worker's sender."""
        worker.running.remove(r)
        start = max(self.now, worker.link_free_at)
        worker.link_free_at = start + self.costs.transfer_time(r.input_len)
        self.at(worker.link_free_at, self._transferred, worker, r)

    def _transferred(self, prefill: _Worker, r: SimRequest) -> None:
        prefill.load -= r.input_len
        r.token_times.append(self.now)
        decode = self.slots[id(r)]
        if r.output_len == 1:
            self.finish(decode, r)
        else:
            decode.add(r, running=True)

    def _first_token(self, worker: _Worker, r: SimRequest) -> None:
        r.token_times.append(self.now)
        if r.output_len == 1:
            worker.running.remove(r)
            self.finish(worker, r)

    def finish(self, worker: _Worker, r: SimRequest) -> None:
        worker.load -= r.input_len + r.output_len
        if self.slots.pop(id(r), None) is not None:
            worker.num_admitted -= 1
            self._admit()


def _least_loaded(workers: list[_Worker]) -> _Worker:
    return min(workers, key=lambda w: w.load)  # ties: the first, as the router's worker-id order


def simulate(spec: ClusterSpec, costs: CostModel,
             workload: list[tuple[float, int, int]]) -> list[SimRequest]:
    """Runs the workload, (arrival s, input tokens, output tokens) per request, to completion."""
    requests = [SimRequest(float(t), int(i), int(o)) for t, i, o in workload]
    if any(r.input_len < 1 or r.output_len < 1 for r in requests):
        raise ValueError("every request needs input and output lengths >= 1")
    return Simulation(spec, costs).run(requests)


def to_records(requests: list[SimRequest]) -> list[RequestRecord]:
    """The simulated requests as a client would have recorded them."""
    return [RequestRecord(prompt_len=r.input_len, max_tokens=r.output_len, send_time=r.arrival,
                          chunk_times=list(r.token_times), num_output_tokens=r.output_len)
            for r in requests]


def metrics(requests: list[SimRequest], slo_ms: dict[str, float] | None = None) -> dict:
    """The serving metrics (bench/serving.py's) over the simulated requests; the duration runs
    from the first arrival (the benchmark's t0) to the last token."""
    duration = max(r.token_times[-1] for r in requests) - min(r.arrival for r in requests)
    return compute_metrics(to_records(requests), duration, slo_ms)
