"""Cost profile of the target on this device: the wall time of one target forward as a function
of the batch size b and the tokens verified per row q (total verify tokens B = b·q), at a fixed
context length. Policies (DSpark's scheduler) and the simulator read the stored profile; the
performance doc quotes it.

Timing: the median over `iters` forwards after `warmup` untimed ones, each bracketed by a device
synchronize (CUDA work is asynchronous; reading the clock without it times the launch, not the work).

`specbench profile` also measures two engine costs the simulator (specbench/analysis/simulate.py) needs and
the bare forward grid leaves out: `prefill` (one forward over right-padded prompts from an empty
cache, rows × prompt tokens) and `round` (one whole decode round of the core, the same (b, q)
grid: verify forward + sampling + acceptance + commit + the loop's own Python). On the 2-core CPU a
core round costs ~9% more than its forward (up to 15%), enough to matter when the simulator is held
to 10% (docs/performance.md, "Simulation vs measurement").

Beside every step time the profile gives its floor: the bytes a step must read (weights once, plus
each row's cached keys and values) over the memory bandwidth measured in the same run
(`streaming_bandwidth`), and the fraction of that floor the step reaches. A small model's decode
step at b = 1 is bound by streaming its weights, so time above the floor is overhead to find.
"""
from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path

import torch

from specbench import atomic
from specbench import resources
from specbench.costs.schema import DRAFTER_COSTS_FILE, drafter_cost_key
from specbench.engine import huge_pages
from specbench.engine.core import SamplingConfig, generate, synchronize
from specbench.engine.model import Transformer, round_to_bucket
from specbench.engine.timing import device_name, time_forward  # noqa: F401 (part of this module's API)
from specbench.engine.policy import BatchState, Draft, Policy


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each shared tensor (tied embeddings) once."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model: Transformer) -> int:
    a = model.args
    element = model.lm_head.weight.element_size()
    return 2 * a.n_layers * a.n_kv_heads * a.head_dim * element


def streaming_bandwidth(device: torch.device | str, n_bytes: int = 2**30, iters: int = 5) -> float:
    """Memory bandwidth in bytes/s, the best of `iters` tries: on a CPU a sum over a buffer far larger
    than the last-level cache (read-only streaming, what a weight-bound step does); on CUDA a
    device-to-device copy (read + write)."""
    device = torch.device(device)
    best = float("inf")
    if device.type == "cuda":
        src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        work, moved = (lambda: dst.copy_(src)), 2 * n_bytes
    else:
        # In 2 MB pages on a CPU, as the weight packs are (engine/huge_pages.py): the floor is the faster read.
        buf = huge_pages.read_probe(n_bytes // 4, device)
        work, moved = buf.sum, n_bytes
    work()
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return moved / best


def floor_ms(model: Transformer, batch: int, context: int, bandwidth: float) -> float:
    """The memory floor of one forward: weights once plus every row's cached K/V, at `bandwidth`."""
    return 1e3 * (weight_bytes(model) + batch * context * kv_bytes_per_token(model)) / bandwidth


def profile(model: Transformer, batches: list[int], qs: list[int], context: int, iters: int = 10, progress=None,
            bandwidth: float | None = None, min_seconds: float = 0.0, max_iters: int = 64) -> dict:
    """The (b, q) cost grid; with `bandwidth` (bytes/s, measured in the same run) each entry also
    carries its memory floor and the fraction of it reached (floor / median).

    Within a batch size the q values are timed in turn, one forward each per pass, `iters` passes:
    a CPU's memory read rate can switch between two levels within seconds (a 1 GiB sum read 29-31
    or 51-59 GB/s on the 2-core EPYC of docs/performance.md "Session 13"), and cells timed one after
    the other then give T(q)/T(1) ratios that mix two machine states; the scheduler and the draft
    gate act on those ratios. At least `iters` passes, and more (up to `max_iters`) until a batch size
    has taken `min_seconds`: small batches, whose ratios are a few per cent apart, get more passes
    for the same time (8 passes of b = 1 on that EPYC put T(2)/T(1) at 1.15 and T(4)/T(1) above
    T(8)/T(1); 40 gave 1.00-1.01 and 1.06-1.10 below 1.16-1.19, three times over)."""
    entries = []
    for b in batches:
        for q in qs:  # warm-up: the cache allocation and each shape's first forward
            time_forward(model, b, q, context, iters=0, warmup=2)
        per_q = {q: [] for q in qs}
        start, passes = time.perf_counter(), 0
        while passes < iters or (passes < max_iters and time.perf_counter() - start < min_seconds):
            for q in qs:
                per_q[q] += time_forward(model, b, q, context, iters=1, warmup=0)
            passes += 1
        for q in qs:
            times = per_q[q]
            entry = {
                "batch": b, "q": q, "verify_tokens": b * q,
                "median_ms": 1e3 * statistics.median(times),
                "min_ms": 1e3 * min(times),
                "p10_ms": 1e3 * sorted(times)[len(times) // 10],
                "p90_ms": 1e3 * sorted(times)[(9 * len(times)) // 10],
                "n": len(times),
            }
            if bandwidth:
                entry["floor_ms"] = floor_ms(model, b, context, bandwidth)
                entry["floor_fraction"] = entry["floor_ms"] / entry["median_ms"]
            entries.append(entry)
            if progress is not None:
                progress.update(1)
    data = {"context": context, "entries": entries}
    if bandwidth:
        data.update(weight_bytes=weight_bytes(model), bandwidth_gb_s=bandwidth / 1e9,
                    bandwidth_method="copy (read + write)" if model.device.type == "cuda" else "sum over 1 GiB (read)")
    return data


def step_time_model(profile_data: dict):
    """A function (rows, q) → seconds per target forward, interpolated from the measured grid:
    piecewise-linear in q within each measured batch size, then in batch size (linear
    extrapolation past the largest measured point, from the last two)."""
    grid: dict[int, list[tuple[int, float]]] = {}
    for e in profile_data["entries"]:
        grid.setdefault(e["batch"], []).append((e["q"], e["median_ms"] / 1e3))
    batches = sorted(grid)
    for b in batches:
        grid[b].sort()

    def interp(points: list[tuple[float, float]], x: float) -> float:
        if len(points) == 1:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                break
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)  # the last segment extrapolates

    @functools.lru_cache(maxsize=65536)  # Algorithm 1 and the draft gate ask for the same few cells every round
    def seconds(rows: int, q: int) -> float:
        per_batch = [(b, interp(grid[b], q)) for b in batches]
        return max(interp(per_batch, rows), 1e-9)

    return seconds


def steps_per_second(profile_data: dict, batch: int) -> dict[int, float]:
    """SPS(B) for a batch of `batch` rows: B = total verify tokens → forwards per second, linearly
    interpolated between measured q values (DSpark Alg. 1 reads this table)."""
    rows = sorted((e["verify_tokens"], e["median_ms"]) for e in profile_data["entries"] if e["batch"] == batch)
    if not rows:
        raise ValueError(f"the profile has no entries for batch size {batch}")
    table = {}
    for total in range(batch, rows[-1][0] + 1):
        lower = max((r for r in rows if r[0] <= total), default=rows[0])
        upper = min((r for r in rows if r[0] >= total), default=rows[-1])
        if upper[0] == lower[0]:
            ms = lower[1]
        else:
            ms = lower[1] + (upper[1] - lower[1]) * (total - lower[0]) / (upper[0] - lower[0])
        table[total] = 1e3 / ms
    return table


PREFILL_POINTS = ((1, 64), (1, 256), (4, 64), (4, 256))  # (rows, prompt tokens per row)


def measure_prefill(model: Transformer, points=PREFILL_POINTS, iters: int = 3) -> list[dict]:
    """Seconds of one prefill forward: `batch` rows of `tokens` prompt tokens from an empty cache."""
    out = []
    for b, p in points:
        times = time_forward(model, b, p, context=0, iters=iters, warmup=1)
        out.append({"batch": b, "tokens": p, "median_ms": 1e3 * statistics.median(times), "n": len(times)})
    return out


def prefill_time_model(entries: list[dict]):
    """(rows, prompt tokens per row) → seconds: piecewise linear in the total rows·tokens the forward
    carries (a 135M–8B prefill is matmul-bound; attention's quadratic part is small at these lengths),
    extrapolated linearly past the measured ends."""
    totals: dict[int, list[float]] = {}
    for e in entries:
        totals.setdefault(e["batch"] * e["tokens"], []).append(e["median_ms"] / 1e3)
    points = sorted((t, statistics.fmean(v)) for t, v in totals.items())

    def seconds(rows: int, tokens: int) -> float:
        x = rows * tokens
        if len(points) == 1:
            return points[0][1] * x / points[0][0]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                break
        return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)

    return seconds


class _TimedDrafts(Policy):
    """Proposes `plan[i]` random drafts in round i (a real target accepts almost none of them) and
    stamps the clock at every proposal: the gap between two proposals is one whole core round."""

    name = "profile-rounds"

    def __init__(self, plan: list[int], vocab: int, seed: int = 0):
        self.plan, self.vocab = plan, vocab
        self.max_draft = max(plan)
        self.generator = torch.Generator().manual_seed(seed)
        self.stamps: list[float] = []

    def propose(self, state: BatchState) -> Draft:
        self.stamps.append(time.perf_counter())
        k = self.plan[len(self.stamps) - 1] if len(self.stamps) <= len(self.plan) else 0
        b, device = state.batch_size, state.tokens.device
        tokens = torch.randint(0, self.vocab, (b, k), generator=self.generator).to(device)
        return Draft(tokens=tokens, probs=None, lengths=torch.full((b,), k, dtype=torch.long, device=device))


def measure_rounds(model: Transformer, batches, qs, context: int, iters: int = 6, warmup: int = 2,
                   progress=None) -> list[dict]:
    """Seconds per decode round of the core (greedy) verifying q − 1 drafts per row, for each batch
    size: one `generate` per batch size over random prompts of `context` tokens, the largest q first
    (so a budget-clamped tail, if any, only touches q = 1, which it cannot shorten)."""
    out = []
    order = sorted(qs, reverse=True)
    for b in batches:
        plan = [q - 1 for q in order for _ in range(warmup + iters)]
        policy = _TimedDrafts(plan, model.args.vocab_size)
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(0, model.args.vocab_size, (b, context), generator=g).tolist()
        generate(model, policy, prompts, SamplingConfig(max_new_tokens=len(plan) + max(qs) + 2), eos_ids=())
        gaps = [t1 - t0 for t0, t1 in zip(policy.stamps, policy.stamps[1:])]
        for i, q in enumerate(order):
            times = gaps[i * (warmup + iters) + warmup : (i + 1) * (warmup + iters)]
            if times:
                out.append({"batch": b, "q": q, "median_ms": 1e3 * statistics.median(times), "n": len(times)})
        if progress is not None:
            progress.update(len(order))
    return out


def save(profile_data: dict, path: str | Path) -> None:
    atomic.write_json(path, profile_data)


PROFILE_BATCHES = (1, 2, 4, 8, 16)
PROFILE_QS = (1, 2, 4, 8)


def committed_profiles() -> list[Path]:
    """The committed profile folders (`results/profiles/`, found as specbench/resources.py says)."""
    return resources.folders("results/profiles")


def measure_profile(target, context: int = 256, batches=PROFILE_BATCHES, qs=PROFILE_QS, iters: int = 8,
                    engine_costs: bool = False, min_seconds: float = 2.0) -> dict:
    """Measure the target's verify-forward cost grid on its device (tqdm progress); with
    engine_costs also the prefill points and the whole-round grid (module docstring)."""
    from tqdm import tqdm

    from specbench.engine.dtypes import dtype_name

    device = target.model.device
    points = len(batches) * len(qs) * (2 if engine_costs else 1)
    bandwidth = streaming_bandwidth(device)
    with tqdm(total=points, desc=f"profiling {target.name} on {device}", unit="point") as bar:
        data = profile(target.model, list(batches), list(qs), context, iters=iters, progress=bar, bandwidth=bandwidth,
                       min_seconds=min_seconds)
        if engine_costs:
            data["round"] = measure_rounds(target.model, list(batches), list(qs), context, progress=bar)
            data["prefill"] = measure_prefill(target.model)
    data.update(target=target.name, target_fingerprint=target.fingerprint, engine_digest=engine_digest(),
                device=str(device), device_name=device_name(device), torch=torch.__version__, dtype=dtype_name(target.model.lm_head.weight.dtype),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    choice = getattr(target, "dtype_choice", None)
    if choice:
        data["dtype_choice"] = choice  # how --dtype was decided (auto: the timings it compared)
    return data


@torch.inference_mode()
def measure_drafter(draft_model, taps_dim: int, batches, context: int = 256, iters: int = 5,
                    min_seconds: float = 1.0, max_iters: int = 64) -> list[dict]:
    """Seconds per drafting round of a block drafter at each batch size, as DSpark's policy runs one in
    greedy decoding (draft_round: the last round's features, 2 tokens a row, join the context of
    `context` committed tokens, then the backbone, Markov loop and confidence head): at least `iters`
    rounds, more (up to `max_iters`) until a batch size has taken `min_seconds` (5 rounds of b = 1 on
    the 2-core EPYC gave 2.9 ms in one run and 4.0 ms in another; the draft gate weighs this cost
    against a verify forward's few per cent). A sampled round (temperature > 0) costs more: its Markov
    loop runs in Python."""
    device = draft_model.device
    out = []
    for b in batches:
        draft_model.setup_cache(b, round_to_bucket(context + 64))
        features = torch.randn(b, context, taps_dim, device=device, dtype=draft_model.dtype)
        draft_model.append_context(features)
        committed = torch.randn(b, 2, taps_dim, device=device, dtype=draft_model.dtype)
        counts = torch.full((b,), 2, dtype=torch.long, device=device)
        anchors = torch.randint(0, draft_model.args.model_args.vocab_size, (b,), device=device)
        times = []
        begin = time.perf_counter()
        for i in range(max(iters, max_iters) + 1):
            if i > iters and time.perf_counter() - begin >= min_seconds:
                break
            draft_model.ctx_len.fill_(context)  # every round appends after the same context
            synchronize(device)
            start = time.perf_counter()
            draft_model.draft_round(committed, counts, anchors, 0.0, with_probs=False)
            synchronize(device)
            if i:
                times.append(time.perf_counter() - start)
        out.append({"batch": b, "median_ms": 1e3 * statistics.median(times), "n": len(times)})
    return out


def draft_time_model(entries: list[dict]):
    """batch → seconds per drafting round, piecewise linear in the batch size."""
    points = sorted((e["batch"], e["median_ms"] / 1e3) for e in entries)

    @functools.lru_cache(maxsize=4096)
    def seconds(rows: int) -> float:
        if len(points) == 1:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if rows <= x1:
                break
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), 0.0)

    return seconds


def engine_digest() -> str:
    """A short hash of the decode core's source (specbench/engine/*.py, its C++ kernels and the
    drafters' modules) and of this module, which measures it: a profile measured with other engine
    code, or measured another way, does not describe this one's step times, so cached and committed
    profiles carry it and are looked up only when it matches."""
    import hashlib

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted([*(root / "engine").glob("*.py"), *(root / "engine").glob("*.cpp"),
                        *(root / "drafters").glob("*.py"), Path(__file__).resolve()]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def drafter_digest(drafter_name: str | None) -> str:
    """A short hash of a drafter checkpoint's drafter.json (architecture, training summary), so a
    retrained or reshaped drafter under the same path is measured again rather than looked up."""
    import hashlib

    from specbench.drafters.checkpoints import CONFIG_NAME, resolve_checkpoint

    try:
        text = (resolve_checkpoint(drafter_name) / CONFIG_NAME).read_bytes()
    except Exception:  # not a checkpoint directory (e.g. "self"): the name alone identifies it
        return "-"
    return hashlib.sha256(text).hexdigest()[:12]


def load_or_measure(target, cache_dir: Path | None = None, drafter=None, drafter_name: str | None = None,
                    variant: str = "") -> dict:
    """Like `load_or_measure_target`, plus the cost of one drafting round of `drafter` per batch size
    (cached under the drafter's name and checkpoint digest, and `variant`, what the loaded drafter changes
    from its checkpoint, e.g. a cut draft vocabulary): the scheduler's step time is draft + verify."""
    data = load_or_measure_target(target, cache_dir)
    if drafter is None:
        return data
    from specbench.engine.loading import default_cache_dir

    from specbench.engine.dtypes import dtype_name

    digest = f"{drafter_digest(drafter_name)}.{engine_digest()}" + (f".{variant}" if variant else "")
    key = drafter_cost_key(drafter_name, digest,
                           device_name(target.model.device),
                           dtype_name(target.model.lm_head.weight.dtype))
    cache = (cache_dir or default_cache_dir()) / "profiles" / DRAFTER_COSTS_FILE
    known = {}
    for path in [*(folder / DRAFTER_COSTS_FILE for folder in committed_profiles()), cache]:
        try:
            known = {**json.loads(path.read_text()), **known}
        except (OSError, json.JSONDecodeError):
            pass
    if key not in known:
        taps_dim = len(drafter.args.tap_layers) * target.model.args.dim
        known[key] = measure_drafter(drafter, taps_dim, PROFILE_BATCHES, context=data["context"])
        save({**(json.loads(cache.read_text()) if cache.is_file() else {}), key: known[key]}, cache)
    return {**data, "draft": known[key]}


def load_or_measure_target(target, cache_dir: Path | None = None) -> dict:
    """This device's cost profile for `target`: a committed one (results/profiles/) or a cached one
    for the same target fingerprint, device name, dtype and engine code (`engine_digest`), else
    measured now (tens of seconds on a CPU) and cached."""
    from specbench.engine.loading import default_cache_dir

    from specbench.engine.dtypes import dtype_name

    device = target.model.device
    wanted = (target.fingerprint, device_name(device), dtype_name(target.model.lm_head.weight.dtype), engine_digest())
    cache = (cache_dir or default_cache_dir()) / "profiles"
    for folder in [*committed_profiles(), cache]:
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            found = (data.get("target_fingerprint"), data.get("device_name"), dtype_name(data.get("dtype", "")),
                     data.get("engine_digest"))
            if found == wanted:
                return data
    data = measure_profile(target)
    slug = "".join(c if c.isalnum() else "-" for c in wanted[1].lower())[:60]
    save(data, cache / f"{target.name}-{slug}-{wanted[2]}.json")
    return data
