"""`pd-serve profile`: measure one worker's step times in-process (an EngineCore, no HTTP).

    pd-serve profile --output bench/results/profile-cpu-smollm2.json --quick --device cpu

Three grids, each point the least of --repeats timed `core.step()` calls (other load on the
machine only ever adds time), except where --sustain-s says otherwise:
  prefill  one step over batched prompts: total tokens 16, 32, ... up to --chunked-prefill-size
           (512 with --quick), each as several prompt mixes (1 prompt of T tokens, 4 of T/4, ...);
           with --sustain-s (default 1 on GPU), the mean of the last --repeats of steps run back
           to back for that long, as a busy prefill worker runs them: a GPU's clocks fall under
           sustained load (an H200 runs a 2048-token step in 47.5 ms alone, 52-53 ms back to
           back);
  decode   one step of `batch` requests with `context` tokens cached, KV pages allocated but not
           computed (the step's time does not depend on their values); where the engine runs the
           overlap schedule (GPU), the time per step of --repeats + 2 steps back to back instead,
           as a serving worker runs them (each launched before the last one's tokens are back);
  mixed    one step with a prompt chunk and a decode batch together (what a colocated worker
           runs), so the planner can check how the two parts add up. Always the least of lone
           steps: a colocated worker's mixed steps alternate with lighter decode steps, and
           timing them back to back makes the planner 25-31 % pessimistic for colocated x2 near
           its knee (on 2 x H200).
Where the engine runs the overlap schedule on a GPU, prefill and mixed points also get host_s
and device_s, each the least of --repeats: the step launched while the device is held busy by
a spin kernel, host_s the launch's wall time and device_s the step's time on the device (CUDA
events around it). A lone step of a few tokens is mostly eager launches (on an H200, 16
prompt tokens take 16.4 ms whole, 16.4-18.3 ms of it launches, 4.8 ms on the device); under
the overlap schedule they hide behind the step before, so the planner charges such a step its
device time (costs.py, pipeline).
The KV transfer is not measured: bytes per token come from the KV layout, the rate and the
per-transfer latency from --transfer-gbps / --transfer-latency-ms. costs.py fits the models.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import os
import time
from pathlib import Path

from pd_serve.cache.pool import pages_for
from pd_serve.config import engine_config_from_args
from pd_serve.planner.provenance import device_name, git_commit, write_json

logger = logging.getLogger(__name__)

# Dense at the small end, where step times bend (see warn_if_noisy: MKL's 2- and 3-row GEMMs)
DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
QUICK_DECODE_BATCHES = (1, 2, 3, 4, 8, 16, 64)
DECODE_CONTEXTS = (64, 256, 1024)
DECODE_SPARE = 8  # tokens a decode point's requests have room for beyond --repeats
MIXED_POINTS = ((64, 4, 256), (256, 4, 256), (64, 32, 256), (256, 32, 256))  # prompt, batch, context
QUICK_MIXED_POINTS = ((256, 16, 256),)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1")
    return values


def mixed_list(text: str) -> list[tuple[int, int, int]]:
    """`2048:64:1024,256:4:256` -> [(2048, 64, 1024), (256, 4, 256)]: prompt, batch, context."""
    try:
        points = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        points = []
    if not points or any(len(m) != 3 or min(m) < 1 for m in points):
        raise argparse.ArgumentTypeError(f"{text!r}: expected PROMPT:BATCH:CONTEXT items >= 1, "
                                         "comma-separated, e.g. 2048:64:1024")
    return points


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profile")
    g.add_argument("--output", required=True, help="where to write the profile JSON")
    g.add_argument("--quick", action="store_true",
                   help="small grids (prefill up to 512 tokens, 4 batch sizes, 2 repeats)")
    g.add_argument("--repeats", type=int, default=None, help="timed steps per point (default 3, quick 2)")
    g.add_argument("--prefill-tokens", type=int_list, default=None,
                   help="batched prompt tokens, e.g. 16,64,256 (default: 16, 32, ... up to the chunk size)")
    g.add_argument("--prefill-mixes", type=int_list, default=[1, 4],
                   help="prompts each token count is split into (default: 1,4)")
    g.add_argument("--decode-batches", type=int_list, default=None,
                   help=f"default: {','.join(map(str, DECODE_BATCHES))} (quick: "
                        f"{','.join(map(str, QUICK_DECODE_BATCHES))})")
    g.add_argument("--decode-contexts", type=int_list, default=list(DECODE_CONTEXTS),
                   help="cached tokens per decoding request (default: 64,256,1024)")
    g.add_argument("--mixed-points", type=mixed_list, default=None,
                   help="colocated steps to time, PROMPT:BATCH:CONTEXT each, e.g. 2048:64:1024 "
                        "(default: " + ",".join(":".join(map(str, m)) for m in MIXED_POINTS) + ")")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU: torch threads (default: torch's); bench/phase_ratio.py gives each "
                        "of N CPU workers cores // N")
    g.add_argument("--sustain-s", type=float, default=None,
                   help="time each prefill point over steps run back to back for this many "
                        "seconds, the mean of the last --repeats (default: 1 on GPU, whose clocks "
                        "fall under sustained load; 0 on CPU: the least of --repeats steps)")
    g.add_argument("--transfer-gbps", type=float, default=10.0,
                   help="KV transfer rate the planner assumes, GB/s (not measured; default: %(default)s)")
    g.add_argument("--transfer-latency-ms", type=float, default=1.0,
                   help="fixed cost per KV transfer, ms (not measured; default: %(default)s)")


def run(args: argparse.Namespace) -> None:
    output = Path(args.output)
    existed = output.exists()
    try:  # a path that cannot be written fails now, not after minutes of measuring
        output.parent.mkdir(parents=True, exist_ok=True)
        open(output, "a").close()
    except OSError as e:
        raise ValueError(f"--output {output}: cannot be written ({e.strerror})") from None
    try:
        record = measure(args)
    except BaseException:
        if not existed:
            output.unlink(missing_ok=True)  # (the empty file opened above: no profile)
        raise
    write_json(output, record)


def measure(args: argparse.Namespace) -> dict:
    busy_at_start = busy_cores()  # before anything of this run uses the cores
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    config = engine_config_from_args(args)
    chunk = config.scheduler.chunked_prefill_size
    chunk = 2048 if chunk < 0 else chunk
    repeats = (2 if args.quick else 3) if args.repeats is None else args.repeats
    tokens = args.prefill_tokens or _powers(16, min(chunk, 512) if args.quick else chunk)
    batches = args.decode_batches or list(QUICK_DECODE_BATCHES if args.quick else DECODE_BATCHES)
    contexts = args.decode_contexts
    default_mixed = QUICK_MIXED_POINTS if args.quick else MIXED_POINTS
    mixed = args.mixed_points or [(p, b, c) for p, b, c in default_mixed  # inside the grids
                                  if p <= max(tokens) and b <= max(batches) and c <= max(contexts)]
    if repeats < 1 or not 0 < args.transfer_gbps < math.inf \
            or not 0 <= args.transfer_latency_ms < math.inf or not 0 <= (args.sustain_s or 0) < math.inf \
            or (args.threads is not None and args.threads < 1):
        raise ValueError("--repeats must be >= 1, --transfer-gbps > 0, --transfer-latency-ms >= 0, "
                         "--sustain-s >= 0 (all finite), --threads >= 1")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    # Room for the largest grid point; the limits the profile is for are recorded as given.
    page = config.cache.page_size
    decoding = lambda b, c: b * pages_for(c + repeats + DECODE_SPARE, page) * page  # noqa: E731
    need = max([decoding(max(batches), max(contexts)), max(tokens) + max(args.prefill_mixes) * page]
               + [decoding(b, c) + p + page for p, b, c in mixed])
    cache = config.cache if config.cache.max_total_tokens else \
        dataclasses.replace(config.cache, max_total_tokens=need)
    sched = dataclasses.replace(config.scheduler,
                                chunked_prefill_size=max(tokens + [chunk]) + max(batches),
                                max_running_requests=max(batches + args.prefill_mixes + [256]))
    core = _build_core(dataclasses.replace(config, cache=cache, scheduler=sched))
    if core.device.type == "cpu" and (warning := busy_machine_warning(busy_at_start)):
        logger.warning("%s", warning)
    _check_context(core.max_model_len, tokens, contexts, mixed, repeats)
    sustain_s = args.sustain_s if args.sustain_s is not None else (1.0 if core.device.type == "cuda" else 0.0)
    t = _Timer(core, repeats, sustain_s)

    prefill = [t.prefill([n // k] * k) for n in tokens for k in args.prefill_mixes if n >= k]
    decode = [[t.decode(b, c) for c in contexts] for b in batches]
    mixed = [t.mixed(p, b, c) for p, b, c in mixed]
    warn_if_noisy(prefill, decode)
    layout = core.kv_pool.layout
    return {
        "kind": "pd-serve-profile", "version": 1,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit(),
        "device": device_name(core.device), "device_type": core.device.type,
        "model": core.model_dir.name, "model_dir": str(core.model_dir),
        "dtype": str(core.dtype).removeprefix("torch."), "max_model_len": core.max_model_len,
        "engine": {"chunked_prefill_size": config.scheduler.chunked_prefill_size,
                   "max_running_requests": config.scheduler.max_running_requests},
        "kv": {**dataclasses.asdict(layout), "bytes_per_token": layout.bytes_per_token},
        "transfer": {"gbps": args.transfer_gbps, "latency_s": args.transfer_latency_ms / 1000,
                     "measured": False},
        "threads": _threads(core.device), "quick": args.quick, "repeats": repeats,
        "sustain_s": sustain_s,
        "prefill": {"points": prefill},
        "decode": {"batch_sizes": batches, "context_lens": contexts, "time_s": decode},
        "mixed": {"points": mixed},
        "wall_s": round(time.perf_counter() - started, 1),
        "load_average": [load_at_start, os.getloadavg()[0]],  # 1-minute, at start and end
        "busy_cores_at_start": busy_at_start,  # other processes' use of the cores (Linux)
    }


def _check_context(max_model_len: int, tokens: list[int], contexts: list[int], mixed, repeats: int) -> None:
    """Every timed sequence fits the model's context (the timer adds requests directly, past
    the checks a served prompt meets; beyond the context the RoPE tables run out)."""
    too_long = [f"--prefill-tokens {n}" for n in tokens if n > max_model_len]
    too_long += [f"--decode-contexts {c} (+{repeats + DECODE_SPARE} decoded)" for c in contexts
                 if c + repeats + DECODE_SPARE > max_model_len]
    too_long += [f"--mixed-points {p}:{b}:{c}" for p, b, c in mixed
                 if max(p, c + repeats + DECODE_SPARE) > max_model_len]
    if too_long:
        raise ValueError(f"{', '.join(too_long)}: longer than the model's context of "
                         f"{max_model_len} tokens (--context-length)")


BUSY_CORES = 0.25  # cores busy on an idle machine stay well below this


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores that all processes kept busy over the next `seconds`, from /proc/stat (Linux; None
    elsewhere). Called before a measurement starts anything, it is what other processes use."""
    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return sum(ticks) - idle, sum(ticks)

    first = sample()
    time.sleep(seconds)
    second = sample()
    if first is None or second is None or second[1] == first[1]:
        return None
    return (second[0] - first[0]) / (second[1] - first[1]) * (os.cpu_count() or 1)


def busy_machine_warning(busy: float | None) -> str | None:
    """A warning when other processes keep `busy` cores busy (see busy_cores): CPU timings then
    come out slower and noisier than the machine's own. Two CPU phase-ratio sweeps run beside
    other load missed the planner at their knees; the same sweep on the idle machine did not
    (README, Planning)."""
    if busy is None or busy <= BUSY_CORES:
        return None
    return (f"other processes kept {busy:.2f} of this machine's {os.cpu_count()} cores busy just "
            "before this run started, so CPU timings will come out slower and noisier (wait for "
            "them to end, or mind the figures)")


def warn_if_noisy(prefill: list[dict], decode: list[list[float]]) -> None:
    """More tokens or a larger batch seldom take less time; when they do, either other load on
    the machine got into the timings, or the kernels change with the shape (on a CPU with
    MKL, fp32 GEMMs of 2 or 3 rows cost 2x and 3x one row while 4 rows cost 1.6x: a 2-core box
    timed decode steps at batch 1/2/3/4 in 59/96/119/88 ms). Either way the grid must be dense
    where times bend: the planner interpolates between its points."""
    fastest: dict[int, float] = {}
    for p in prefill:
        fastest[p["num_tokens"]] = min(p["time_s"], fastest.get(p["num_tokens"], float("inf")))
    times = [fastest[n] for n in sorted(fastest)]
    columns = [list(col) for col in zip(*decode)]
    if any(b < 0.8 * a for series in [times, *columns, *decode] for a, b in zip(series, series[1:])):
        logger.warning("step times fall where they should rise (prefill %s, decode %s): other "
                       "load on this machine got into them (re-run when it is idle), or the kernels "
                       "change with the shape (keep such points: the planner needs them)",
                       [round(t, 3) for t in times], [[round(t, 3) for t in row] for row in decode])


class _Timer:
    """Timed steps on a live EngineCore; every request it adds is finished (pages freed)."""

    def __init__(self, core, repeats: int, sustain_s: float = 0.0):
        """Notes whether `core` runs the overlap schedule (decode points are then timed as a
        worker runs them), then turns it off: every other timed step is one whole step."""
        self.core, self.repeats, self.overlap = core, repeats, core.overlap
        self.sustain_s = sustain_s
        self._spin_cycles_per_s = None
        core.overlap = False

    def prefill(self, prompt_lens: list[int]) -> dict:
        def add():
            return [self._waiting(n) for n in prompt_lens]
        time_s = self._whole_steps(add, sum(prompt_lens), self.sustain_s)
        return {"num_tokens": sum(prompt_lens), "prompt_lens": prompt_lens,
                "attn_pairs": sum(n * n for n in prompt_lens), "time_s": time_s,
                **self._host_and_device(add, sum(prompt_lens))}

    def _whole_steps(self, add_requests, expected_tokens: int, sustain_s: float = 0.0) -> float:
        """The least of --repeats steps; with sustain_s, the mean of the last --repeats of
        steps run back to back for that long."""
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < self.repeats or time.perf_counter() - started < sustain_s:
            requests = add_requests()
            times.append(self._step(expected_tokens))
            self._finish(requests)
        if sustain_s:
            return sum(times[-self.repeats:]) / self.repeats
        return min(times)

    def decode(self, batch: int, context: int) -> float:
        requests = [self._decoding(context) for _ in range(batch)]
        if self.overlap:
            elapsed = self._back_to_back(batch, self.repeats + 2)
        else:
            self._step(batch)  # untimed: the first step after a shape change
            elapsed = min(self._step(batch) for _ in range(self.repeats))
        self._finish(requests)
        return elapsed

    def mixed(self, prompt_len: int, batch: int, context: int) -> dict:
        def add():
            return [self._decoding(context) for _ in range(batch)] + [self._waiting(prompt_len)]
        time_s = self._whole_steps(add, prompt_len + batch)
        return {"prefill_tokens": prompt_len, "attn_pairs": prompt_len * prompt_len,
                "batch_size": batch, "context_len": context, "time_s": time_s,
                **self._host_and_device(add, prompt_len + batch)}

    def _host_and_device(self, add_requests, expected_tokens: int) -> dict:
        """Under the overlap schedule on a GPU: {host_s, device_s} (module docstring), else {}.
        The spin lasts 0.2 s, longer than any launch; a launch that waits for the device (a host
        sync in it) shows as host_s >= the spin, and gets device_s None (a warning says so)."""
        if not self.overlap or self.core.device.type != "cuda":
            return {}
        import torch
        spin_s = 0.2
        if self._spin_cycles_per_s is None:  # the spin kernel's clock, measured once
            self._spin_cycles_per_s = _spin_rate(self.core.device)
        hosts, devices = [], []
        for _ in range(self.repeats):
            requests = add_requests()
            self._sync()
            with torch.cuda.device(self.core.device):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(spin_s * self._spin_cycles_per_s))
                start.record()
                began = time.perf_counter()
                self.core.overlap = True
                self.core.step()  # nothing in flight: it launches and returns
                hosts.append(time.perf_counter() - began)
                end.record()
            launched = self.core._launched.plan.num_tokens
            self.core.drain()
            self.core.overlap = False
            self._sync()
            devices.append(start.elapsed_time(end) / 1000)
            self._finish(requests)
            assert launched == expected_tokens, (launched, expected_tokens)
        if min(hosts) >= 0.8 * spin_s:  # no device_s: the planner keeps whole steps
            logger.warning("a %d-token step's launch took %.3f s behind a %.1f s spin: it waits for "
                           "the device, so the overlap schedule cannot hide it", expected_tokens,
                           min(hosts), spin_s)
            return {"host_s": min(hosts), "device_s": None}
        return {"host_s": min(hosts), "device_s": min(devices)}

    def _waiting(self, num_tokens: int):
        request = _request(num_tokens)
        self.core.scheduler.add(request)
        return request

    def _decoding(self, context: int):
        """A request as the decode worker holds it after the KV arrived: `context` tokens cached,
        token 1 out, pages for the steps to come reserved."""
        request = _request(context)
        page = self.core.kv_pool.layout.page_size
        page_ids = self.core.allocator.allocate(pages_for(context + self.repeats + DECODE_SPARE, page))
        if page_ids is None:
            raise ValueError("the KV cache is too small for the decode grid; raise --max-total-tokens")
        request.page_ids = page_ids
        request.num_computed_tokens = context
        request.output_token_ids.append(100)
        self.core.scheduler.add_running(request)
        return request

    def _back_to_back(self, batch: int, steps: int) -> float:
        """Seconds per step of `steps` overlap-schedule steps in a row: each call launches the
        next step, then waits for the one before."""
        self.core.overlap = True
        self.core.step()  # untimed: the first after a shape change; launches, returns nothing
        self.core.step()  # untimed: launches the second, waits for the first
        start = time.perf_counter()
        for _ in range(steps):
            plan, _ = self.core.step()
            assert plan.num_tokens == batch, (plan.num_tokens, batch)
        elapsed = time.perf_counter() - start
        self.core.drain()
        self.core.overlap = False
        return elapsed / steps

    def _sync(self) -> None:
        import torch
        if self.core.device.type == "cuda":
            torch.cuda.synchronize(self.core.device)

    def _step(self, expected_tokens: int) -> float:
        self._sync()
        start = time.perf_counter()
        plan, _ = self.core.step()
        self._sync()
        elapsed = time.perf_counter() - start
        assert plan.num_tokens == expected_tokens, (plan.num_tokens, expected_tokens)
        return elapsed

    def _finish(self, requests) -> None:
        from pd_serve.engine.request import FinishReason
        for request in requests:
            self.core.scheduler.finish(request, FinishReason.ABORT)


def _spin_rate(device) -> float:
    """Cycles per second of torch.cuda._sleep, timed over a 10M-cycle spin."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1000)


def _request(num_tokens: int):
    from pd_serve.engine.request import Request
    from pd_serve.engine.sampling_params import SamplingParams

    ids = [100 + i % 1000 for i in range(num_tokens)]
    return Request(ids, SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True))


def _threads(device) -> int | None:
    import torch
    return torch.get_num_threads() if device.type == "cpu" else None


def _build_core(config):
    from pd_serve.engine.core import EngineCore
    core = EngineCore(config, prefix_cache=False)  # every step computes all its tokens
    core.warmup()
    return core


def _powers(start: int, limit: int) -> list[int]:
    """start, 2 * start, ... up to limit, and limit itself."""
    values = [start]
    while values[-1] * 2 <= limit:
        values.append(values[-1] * 2)
    return values + ([limit] if values[-1] != limit and limit > start else [])
