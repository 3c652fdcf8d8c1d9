"""Turns one step's logits into one token per request, with vLLM's sampling semantics.

Order of work per row: raw logprobs (if asked) -> logit_bias -> penalties -> EOS and stop ids
masked while short of min_tokens -> grammar mask (a row whose request has a grammar matcher:
engine/grammar.py) -> greedy argmax, or
temperature -> min_p -> top_k -> top_p -> exponential-race sample.
Random numbers come from the request's own generator when it has a seed, drawn on CPU per row
so a seeded row's token never depends on the batch or the device; the other rows draw theirs
in one call on the logits' device (a [B, V] draw on the host would cost far more than the
step on a GPU).
"""

from __future__ import annotations

import threading
from array import array

import torch

from kernels.argmax import argmax
from pd_serve.engine.grammar import advance_grammars, apply_grammars, needs_grammar
from pd_serve.engine.plan import StepResult
from pd_serve.engine.request import Request, TokenLogprob
from pd_serve.engine.sampling_params import SamplingParams

SamplerOutput = StepResult  # one sampled token per row, and its logprobs where asked for


class PendingSample:
    """A step's samples while the device may still be computing them: `tokens` [B] stays on the
    device (the next step reads its inputs from it); result() waits for the copies to the host."""

    def __init__(self, tokens: torch.Tensor, params: list[SamplingParams],
                 logprob_parts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 prompt_logprobs: dict | None = None):
        self.tokens, self.params = tokens, params
        on_cuda = tokens.device.type == "cuda"
        parts = (tokens,) + (logprob_parts or ())
        # Copies into pinned host memory, queued behind the sampling kernels; no wait here.
        # (tokens may be a buffer the next step rewrites: the decode graph's.)
        self._host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                      if on_cuda else p.clone() for p in parts]
        self._event = torch.cuda.Event() if on_cuda else None
        if self._event is not None:
            self._event.record()
        self._result: SamplerOutput | None = None
        # StepResult's (the runner's, already on the host): given here, before the grammar
        # thread can ask for the result
        self.prompt_logprobs: dict = prompt_logprobs or {}
        self._lock = threading.Lock()  # the grammar thread may ask too (engine/grammar.py)

    def result(self) -> SamplerOutput:
        """Wait for the copies (once; the grammar thread may ask first)."""
        with self._lock:
            return self._wait()

    def _wait(self) -> SamplerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            token_list = self._host[0].tolist()
            logprobs = [None] * len(token_list) if len(self._host) == 1 else \
                _logprobs(self._host[1], self._host[2], token_list, self.params)
            self._result = SamplerOutput(token_list, logprobs, self.prompt_logprobs)
        return self._result


class DeferredSample:
    """A step's sampling, queued on the device only when first needed (its `tokens` or
    result() asked for). Rows under a grammar wait for their masks (the grammar thread's job on
    the step before); deferred, that wait comes after the engine's host work on the step before
    (engine/core.py asks for `tokens` as it launches the next step), not before it."""

    def __init__(self, launch, params: list[SamplingParams]):
        self._launch, self.params = launch, params  # launch() -> PendingSample
        self._pending: PendingSample | None = None

    def launch(self) -> PendingSample:
        if self._pending is None:
            self._pending = self._launch()
        return self._pending

    @property
    def tokens(self) -> torch.Tensor:
        return self.launch().tokens

    def result(self) -> SamplerOutput:
        return self.launch().result()


def _ids(ids: list[int], device: torch.device) -> torch.Tensor:
    """Token ids as an int64 tensor on `device` (through an array: a list of Python ints is
    converted at half the speed)."""
    return torch.frombuffer(array("q", ids), dtype=torch.long).to(device) if ids else (
        torch.zeros(0, dtype=torch.long, device=device))


def _kept(kept: dict, params: SamplingParams, device: torch.device) -> tuple | None:
    """A Sampler cache's entry (params, tensor, ...) of the last step for these params, if its
    tensors are on `device` (the key is id(params); the entry holds them, so it is theirs)."""
    entry = kept.get(id(params))
    return entry if entry is not None and entry[0] is params and entry[1].device == device else None


def _token_counts(rows: list[torch.Tensor], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Count each id per row (int64 id tensors on `device`): [B, V] int64. Padding goes to an
    extra column that is dropped."""
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=vocab_size)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]  # [B, V]


def needs_penalties(requests: list[Request]) -> bool:
    return any(
        p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        for p in (r.sampling_params for r in requests)
    )


def apply_penalties(logits: torch.Tensor, requests: list[Request],
                    ids: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """Return float32 logits [B, V] with repetition, frequency and presence penalties applied.

    repetition_penalty r scales every id seen in prompt or output: logit/r if logit > 0 else
    logit*r. Then logit -= frequency_penalty * count_in_output + presence_penalty * (count > 0).
    The input tensor is not modified. ids: each row's (prompt ids, output ids) as int64
    tensors on the logits' device (the Sampler keeps them between steps); else read from the
    requests.
    """
    logits = logits.float()
    if not needs_penalties(requests):
        return logits.clone()
    vocab_size = logits.shape[1]
    device = logits.device
    params = [r.sampling_params for r in requests]
    if ids is None:
        ids = [(_ids(r.prompt_token_ids, device), _ids(r.output_token_ids, device))
               for r in requests]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [B, 1]

    output_counts = _token_counts([output for _, output in ids], vocab_size, device)
    output_seen = output_counts > 0  # [B, V]
    prompt_seen = _token_counts([prompt for prompt, _ in ids], vocab_size, device) > 0

    # A penalty far from 1 overflows float32 (a Python double of 1e-46 is 0 here): the
    # penalty and the scaled logits stay finite, so the softmax never sees inf - inf.
    finite = torch.finfo(torch.float32)
    rep = column([p.repetition_penalty for p in params]).clamp(finite.tiny, finite.max)
    scaled = torch.where(logits > 0, logits / rep, logits * rep).clamp(-finite.max, finite.max)
    logits = torch.where(prompt_seen | output_seen, scaled, logits)
    logits = logits - column([p.frequency_penalty for p in params]) * output_counts
    logits = logits - column([p.presence_penalty for p in params]) * output_seen
    return logits


def _filter(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Mask to -inf what min_p, top_k and top_p drop; logits [B, V] already temperature-scaled."""
    params = [r.sampling_params for r in requests]
    vocab_size = logits.shape[1]
    device = logits.device
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)  # [B, V]
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not (use_top_k or use_top_p):
        return logits

    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V] each
    ranks = torch.arange(vocab_size, device=device).unsqueeze(0)  # [1, V]
    # (a top_k past the vocabulary keeps all of it, and one past int64 cannot make a tensor)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                         device=device)
    drop = ranks >= top_k.unsqueeze(1)  # [B, V] in sorted order
    if use_top_p:
        # top_p = 1 rows get 2.0 so rounding in the cumulative sum can never drop their tail.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Mass of the higher-ranked tokens; the top token always survives (a top_p that
        # rounds to 0 in float32 would drop it too).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = drop | ((mass_before >= top_p.unsqueeze(1)) & (ranks > 0))
    drop_by_id = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop_by_id, float("-inf"))


def seeded_generator(seed: int) -> torch.Generator:
    """A request's own (CPU) generator. torch's CPU generator keeps 32 bits of a seed: seeds in
    [0, 2**32) are taken as they are; any other API seed (negative, or past 32 bits) is mixed
    down to 32 bits by splitmix64's finalizer, so that nearby seeds (-1 and 0, 1 and 2**32 + 1)
    do not sample alike, as cutting or folding the bits would make them."""
    if 0 <= seed < 2**32:
        return torch.Generator().manual_seed(seed)
    mask = 2**64 - 1
    z = seed & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return torch.Generator().manual_seed((z ^ (z >> 31)) >> 32)


class Sampler:
    """Samples one token per row. Holds the engine-wide generator for requests without a seed."""

    def __init__(self, seed: int = 0, eos_token_ids=()):
        self.seed = seed
        self.eos_token_ids = sorted(eos_token_ids)  # masked under min_tokens (unless ignore_eos)
        self.generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}
        # id(sampling params) -> (them, token ids, biases): the logit_bias of the last step's
        # rows as tensors on the logits' device
        self._biases: dict[int, tuple[SamplingParams, torch.Tensor, torch.Tensor]] = {}
        # id(sampling params) -> (them, prompt ids, output ids): the token ids of the last
        # step's rows, as tensors on the logits' device, for their penalties
        self._histories: dict[int, tuple[SamplingParams, torch.Tensor, torch.Tensor]] = {}
        # id(sampling params) -> (them, ids): the stop ids the last step's rows short of
        # min_tokens masked, on the logits' device
        self._masked: dict[int, tuple[SamplingParams, torch.Tensor]] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows on `device` (ours on CPU; one per accelerator)."""
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._device_generators[device]

    def _with_logit_bias(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits [B, V] with each row's logit_bias added, as a new float32 tensor; the input
        itself when no row has one. A request's bias becomes tensors on the logits' device at
        the first step it is sampled in and is kept while it is in every step: read from its
        dict each step, n=128 choices biasing the whole vocabulary took 3.7 s a step on 2 CPU
        cores, for every request on the worker."""
        kept, self._biases = self._biases, {}
        biased = None
        for i, request in enumerate(requests):
            params = request.sampling_params
            if not params.logit_bias:
                continue
            entry = _kept(kept, params, logits.device) or (
                params, _ids(list(params.logit_bias), logits.device),
                torch.frombuffer(array("f", params.logit_bias.values()),
                                 dtype=torch.float32).to(logits.device))
            self._biases[id(params)] = entry
            if biased is None:
                biased = logits.float().clone()
            biased[i].index_add_(0, entry[1], entry[2])
        return logits if biased is None else biased

    def _penalty_ids(self, requests: list[Request],
                     device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's (prompt ids, output ids) on `device` for apply_penalties. A row's tensors
        are kept while it is in every step and its new outputs appended (all rows' in one copy
        to the device): made anew from its id lists each step, 128 rows of 3k tokens took 19 ms
        of host time (on 2 CPU cores; kept: 5 ms on CPU tensors, a device op on a GPU's)."""
        kept, self._histories = self._histories, {}
        entries, new_ids, grown = [], [], []  # grown: (row, how many new ids)
        for i, request in enumerate(requests):
            params, known = request.sampling_params, request.all_token_ids
            num_prompt = request.num_prompt_tokens
            entry = _kept(kept, params, device) or (
                params, _ids(known[:num_prompt], device), _ids([], device))
            done = num_prompt + len(entry[2])
            if len(known) > done:
                new_ids += known[done:]
                grown.append((i, len(known) - done))
            entries.append(entry)
        if grown:
            parts = _ids(new_ids, device).split([n for _, n in grown])
            for (i, _), part in zip(grown, parts):
                params, prompt, output = entries[i]
                entries[i] = (params, prompt, torch.cat([output, part]))
        for entry in entries:
            self._histories[id(entry[0])] = entry
        return [entry[1:] for entry in entries]

    def _exponentials(self, requests: list[Request], sampled_rows: list[int], vocab_size: int,
                      device: torch.device) -> torch.Tensor:
        """Exp(1) noise [B, V] on `device`: seeded rows from their own (CPU) generator, the rest
        from ours on the device. Rows not sampled (greedy) stay 1 and consume no random numbers."""
        noise = torch.ones(len(requests), vocab_size, device=device)  # [B, V]
        unseeded = [i for i in sampled_rows if requests[i].generator is None]
        if unseeded:
            draws = torch.empty(len(unseeded), vocab_size, device=device)  # [U, V]
            noise[unseeded] = draws.exponential_(generator=self._generator(device))
        seeded = [i for i in sampled_rows if requests[i].generator is not None]
        if seeded:
            rows = torch.empty(len(seeded), vocab_size)  # [S, V] on the host
            for row, i in zip(rows, seeded):
                row.exponential_(generator=requests[i].generator)
            noise[seeded] = rows.to(device)
        # A zero draw would give inf/nan in probs / noise; exponential_ can return 0 in float32.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row.

        logits: [B, V], any float dtype and device; computed in float32. Row i is requests[i].
        """
        return self.launch(logits, requests).result()

    @staticmethod
    def argmax_only(requests: list[Request], positions: list[int] | None = None) -> bool:
        """Whether each row's token is its logits' argmax alone: greedy, no logprobs, no
        logit_bias, no penalties, no min_tokens mask, no grammar (the decode CUDA graph computes
        it itself). positions: as launch's."""
        return (all(r.sampling_params.greedy and r.sampling_params.logprobs is None
                    and not r.sampling_params.logit_bias for r in requests)
                and not needs_penalties(requests) and not needs_grammar(requests)
                and not _short_of_min_tokens(requests, positions))

    def launch(self, logits: torch.Tensor, requests: list[Request],
               positions: list[int] | None = None,
               prompt_logprobs: dict | None = None) -> PendingSample | DeferredSample:
        """Queue the sampling of one token per row on the logits' device; no host sync (the
        seeded noise of non-greedy rows is drawn on the host first). A row with a `grammar`
        (a GrammarState) samples inside it; its matcher takes the token in the background.
        A step with grammar rows is deferred (DeferredSample): `logits` must stay as they are
        until its tokens are asked for (the next forward is queued after that).
        positions: where each row's token goes in its request (prompt + outputs before it; the
        one before may still be in flight); default: after all its known tokens.
        prompt_logprobs: the step's (StepResult's), carried by the result."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), "one logits row per request"
        params = [r.sampling_params for r in requests]
        if self.argmax_only(requests, positions):
            return PendingSample(argmax(logits), params, prompt_logprobs=prompt_logprobs)
        args = (logits, requests, params, positions, prompt_logprobs)
        if needs_grammar(requests):
            return DeferredSample(lambda: self._launch(*args), params)
        return self._launch(*args)

    def _stop_masks(self, requests: list[Request], positions: list[int] | None,
                    logits: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(row, ids on the logits' device) to mask for each row short of its min_tokens: its
        stop ids and, unless ignore_eos, the model's EOS ids. A request's ids are made once and
        kept while it is short (a host->device copy per step could wait for the forward)."""
        kept, self._masked = self._masked, {}
        out = []
        for i in _short_of_min_tokens(requests, positions):
            params = requests[i].sampling_params
            entry = _kept(kept, params, logits.device)
            if entry is None:
                ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
                entry = (params, _ids(sorted(t for t in ids if t < logits.shape[1]), logits.device))
            self._masked[id(params)] = entry
            out.append((i, entry[1]))
        return out

    def _launch(self, logits: torch.Tensor, requests: list[Request],
                params: list[SamplingParams], positions: list[int] | None = None,
                prompt_logprobs: dict | None = None) -> PendingSample:
        want_logprobs = [p.logprobs is not None for p in params]

        vocab_size = logits.shape[1]
        device = logits.device
        raw_logprobs = logits.float().log_softmax(dim=-1) if any(want_logprobs) else None  # [B, V]
        original = logits
        logits = self._with_logit_bias(logits, requests)
        if needs_penalties(requests):
            logits = apply_penalties(logits, requests, self._penalty_ids(requests, device))
        else:
            logits = logits.float()  # only read from here on, so no copy is needed
        masks = self._stop_masks(requests, positions, logits)
        if masks or needs_grammar(requests):
            if logits.data_ptr() == original.data_ptr():  # masked in place: not the runner's
                logits = logits.clone()
            for row, ids in masks:
                logits[row].index_fill_(0, ids, float("-inf"))
            if needs_grammar(requests):
                apply_grammars(logits, requests)
        token_ids = argmax(logits)  # [B]

        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            # Greedy rows get temperature 1 here; their argmax above is kept below.
            temps = [1.0 if p.greedy else p.temperature for p in params]
            scaled = logits / torch.tensor(temps, device=device).unsqueeze(1)
            probs = _filter(scaled, requests).softmax(dim=-1)  # [B, V]
            noise = self._exponentials(requests, sampled_rows, vocab_size, device)
            drawn = (probs / noise).argmax(dim=-1)  # [B] exponential race
            is_sampled = torch.tensor([not p.greedy for p in params], device=device)
            token_ids = torch.where(is_sampled, drawn, token_ids)

        parts = None if raw_logprobs is None else _logprob_parts(raw_logprobs, token_ids, params)
        pending = PendingSample(token_ids, params, parts, prompt_logprobs)
        advance_grammars(pending, requests, vocab_size)
        return pending


def _short_of_min_tokens(requests: list[Request], positions: list[int] | None) -> list[int]:
    """The rows whose token may not be a stop yet: fewer outputs before it than min_tokens."""
    rows = []
    for i, request in enumerate(requests):
        if request.sampling_params.min_tokens:
            at = len(request.all_token_ids) if positions is None else positions[i]
            if not request.sampling_params.may_stop(at - request.num_prompt_tokens):
                rows.append(i)
    return rows


def _logprob_parts(raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                   params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sampled token's logprob then the top-N logprobs [B, 1 + N] (N: the largest
    params.logprobs), and the top-N ids [B, N]. raw_logprobs [B, V], token_ids [B]."""
    max_n = max(p.logprobs for p in params if p.logprobs is not None)
    sampled_lp = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
    top_lp, top_ids = raw_logprobs.topk(max_n, dim=-1)  # [B, N], sorted descending
    return torch.cat([sampled_lp, top_lp], dim=1), top_ids


def score_tokens(logits: torch.Tensor, targets: torch.Tensor,
                 num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt logprobs: per row of logits [N, V], the logprob of its target token [N] (the raw
    model's, as for sampled tokens), the top num_top logprobs [N, k] and their ids [N, k], and
    the target's rank [N] (1 + the tokens likelier than it, as vLLM counts)."""
    raw = logits.float().log_softmax(dim=-1)
    top_lp, top_ids = raw.topk(num_top, dim=-1)
    target = raw.gather(1, targets.unsqueeze(1))
    return target.squeeze(1), top_lp, top_ids, (raw > target).sum(dim=1) + 1


def _logprobs(lp: torch.Tensor, top_ids: torch.Tensor, token_list: list[int],
              params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """TokenLogprobs from _logprob_parts' tensors (on the host) and the sampled ids."""
    both, top_ids = lp.tolist(), top_ids.tolist()  # [B, 1 + N], [B, N]
    out: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i][: p.logprobs], both[i][1 : 1 + p.logprobs]))
        out.append(TokenLogprob(token_id=token_list[i], logprob=both[i][0], top=top))
    return out


def advance_generator(request, vocab_size: int) -> None:
    """Consume the random draws one sampled token takes from a seeded request's generator
    (request: anything with `generator` and `sampling_params`).

    A request whose first token was sampled in another process (prefill) continues here
    (decode) from the same point of its random stream, so seeded output does not depend on
    whether the request was disaggregated.
    """
    if request.generator is not None and not request.sampling_params.greedy:
        torch.empty(vocab_size, dtype=torch.float32).exponential_(generator=request.generator)
