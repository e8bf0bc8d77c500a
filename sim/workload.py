"""Request streams for the simulator, from the real traces of ../shared/traces (fitted by
`sim.fit_traces`; the bundled fit is used unless `trace_dir` is given).

No public trace has request rows for many named models, so each source maps something onto the
catalog's models (see `WorkloadConfig.source`):

- "azure_functions" (default): a model is an Azure Functions 2019 function. Popularity: model
  m's mean rate is drawn from the empirical distribution of the 500 functions' mean rates (a
  rank u ~ U(0, 1) over the sorted rates, log-linear interpolation between neighbouring ranks).
  A lognormal fit (mu -2.36, sigma 2.61 on ln invocations/min) was rejected: it gives the top 1%
  of 500 functions 48% of the invocations where the sample has 84%. Shape: the model's rate over
  time follows, for each 480-minute segment of the run, the per-minute counts of a function drawn
  with replacement among the 11 of nearest rank (so a rarely-invoked model gets a sparse,
  on/off shape and a busy one a smooth shape, as in the sample), rescaled to the model's rate.
  Per-minute counts are Poisson around that, and arrivals within a minute follow a Gamma
  renewal process whose CV is drawn per model from ServeGen's inter-arrival CVs of all active
  client-windows (median 1.23, p90 4.9; clipped to [0.1, 10]), placed as upstream does: the
  gaps are rescaled to fill the window. ServeGen's CVs were measured over 10-minute windows, so
  they also carry minute-to-minute variation the per-minute counts already have: an upper bound
  on sub-minute burstiness. `arrival_process="poisson"` (uniform within the minute) is the
  lower bound.
- "servegen": a model is a (model, client) pair of ServeGen's Alibaba Model Studio data (421
  active clients): mean rate drawn as above from the clients' mean rates, shape = the client's
  mean rate per hour of the day (24 values, so a model's day repeats), within-hour arrivals a
  Gamma renewal process with the client's median CV.
- "azure_llm": the request rows of the Azure LLM 2023 trace replayed (58 minutes, repeated to
  fill `hours`). Each model serves one service, code or conv: the two most popular models (by the
  azure_functions popularity above) take conv and code, every other model draws its service with
  the services' request shares (69% conv / 31% code); each row goes to one of its service's
  models with probability proportional to that popularity. Tokens are the row's own.

Token counts (all sources but azure_llm): each model is assigned a service as in "azure_llm" and
its requests draw input and output tokens independently from that service's empirical
quantiles (code: input p50 1469 / output p50 13; conv: 1020 / 129).

Load: `requests_per_model_per_hour` is the mean over models; the per-model rates are rescaled
so the catalog's mean is exactly that over whole segments (8 h for azure_functions, a day for
servegen: a shorter run sees the part of the shape it covers, e.g. servegen's quieter night). The default, 63, is the sample's mean function rate
(12.66/min) scaled so that the busiest function (3,991/min) would be served at the rate of the
busier Azure LLM service (conv, 5.53 req/s): 12.66 x 60 x 5.53 x 60 / 3991 = 63.1. For
"azure_llm" the default (None) replays the rows as recorded (8.02 req/s in all); a value
replays each row floor(s) or ceil(s) times (s = the requested total / the recorded one).

Generation is lazy, one time bin (a minute; an hour for servegen) at a time, vectorised over
models with numpy, so 10,000 models x 24 h streams in bounded memory.
"""

from __future__ import annotations

import csv
import gzip
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.fit_traces import LLM_FILE, load_trace_fit
from sim.sim_models import SimModel

__all__ = ["SimRequest", "WorkloadConfig", "WorkloadSummary", "SOURCES", "ARRIVAL_PROCESSES",
           "DEFAULT_REQUESTS_PER_MODEL_PER_HOUR", "generate_workload", "expected_requests_per_hour",
           "model_services", "summarize_workload"]

SOURCES = ("azure_functions", "servegen", "azure_llm")
ARRIVAL_PROCESSES = ("gamma", "poisson")
DEFAULT_REQUESTS_PER_MODEL_PER_HOUR = 63.1
NEIGHBOUR_RANKS = 5  # a segment's shape comes from the function of nearest rank +- this many
CV_RANGE = (0.1, 10.0)
_CONV_SHARE = 19366 / 28185  # request share of the conv service in the Azure LLM 2023 trace


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    model_id: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate. `trace_dir` None uses the bundled fit (sim/data); a folder refits from
    its raw files. `requests_per_model_per_hour` None takes the source's default (module doc)."""

    num_models: int
    hours: float
    seed: int = 0
    trace_dir: Path | None = None
    source: str = "azure_functions"
    requests_per_model_per_hour: float | None = None
    arrival_process: str = "gamma"

    def __post_init__(self) -> None:
        if not isinstance(self.num_models, int) or isinstance(self.num_models, bool) or self.num_models < 1:
            raise ValueError(f"WorkloadConfig.num_models must be an int >= 1, got {self.num_models!r}")
        if isinstance(self.hours, bool) or not isinstance(self.hours, (int, float)) or not math.isfinite(self.hours) \
                or self.hours <= 0:
            raise ValueError(f"WorkloadConfig.hours must be a finite number > 0, got {self.hours!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"WorkloadConfig.seed must be an int >= 0, got {self.seed!r}")
        if self.trace_dir is not None and not isinstance(self.trace_dir, Path):
            raise ValueError(f"WorkloadConfig.trace_dir must be a pathlib.Path or None, got {self.trace_dir!r}")
        if self.source not in SOURCES:
            raise ValueError(f"WorkloadConfig.source must be one of {SOURCES}, got {self.source!r}")
        rate = self.requests_per_model_per_hour
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not math.isfinite(rate) or rate <= 0):
            raise ValueError(f"WorkloadConfig.requests_per_model_per_hour must be a number > 0 or None "
                             f"(the source's default), got {rate!r}")
        if self.arrival_process not in ARRIVAL_PROCESSES:
            raise ValueError(f"WorkloadConfig.arrival_process must be one of {ARRIVAL_PROCESSES}, "
                             f"got {self.arrival_process!r}")
        if self.source == "azure_llm" and self.trace_dir is None:
            raise ValueError(f"source 'azure_llm' replays the trace's request rows, which are not bundled: set "
                             f"trace_dir (--trace-dir) to the folder holding {LLM_FILE} (../shared/traces)")


@dataclass(frozen=True)
class WorkloadSummary:
    """Requests per model id (models with none are absent), their total, and the last arrival."""

    requests_per_model: dict[str, int] = field(default_factory=dict)
    total: int = 0
    last_arrival_s: float = 0.0


def summarize_workload(requests: Iterable[SimRequest]) -> WorkloadSummary:
    counts: Counter[str] = Counter()
    last = 0.0
    for r in requests:
        counts[r.model_id] += 1
        last = r.arrival_s
    return WorkloadSummary(dict(counts), sum(counts.values()), last)


# --- the plan: everything drawn once per (config, catalog) -------------------------------------


@dataclass(frozen=True)
class _Library:
    """Rate shapes: `shapes[f, b]` (mean 1 over the `bins` of a segment) and per-f mean rates."""

    rates: np.ndarray  # [F] mean requests per bin, sorted ascending
    shapes: np.ndarray  # [F, bins]
    bin_s: float
    cvs: np.ndarray | None  # [F] per-f inter-arrival CV (servegen) or None


@dataclass(frozen=True)
class _Plan:
    library: _Library
    model_rate_per_bin: np.ndarray  # [N] after scaling
    segment_functions: np.ndarray  # [N, segments] rows of library.shapes
    shape_k: np.ndarray  # [N] Gamma shape of the inter-arrival gaps (1 = Poisson)
    service: np.ndarray  # [N] 0 = code, 1 = conv
    num_bins: int


def _functions_library(fit: dict) -> _Library:
    af = fit["azure_functions"]
    rates = np.array(af["rates_per_bin"], dtype=float)
    shapes = np.zeros((len(rates), af["minutes"]))
    for f, pairs in enumerate(af["counts"]):
        for minute, count in pairs:
            shapes[f, minute] = count
    shapes /= shapes.mean(axis=1, keepdims=True)
    order = np.argsort(rates, kind="stable")
    return _Library(rates[order], shapes[order], float(af["bin_s"]), None)


def _servegen_library(fit: dict) -> _Library:
    clients = fit["servegen"]["clients"]
    rates = np.array([c["rate_rps"] for c in clients]) * 3600
    shapes = np.array([c["hourly"] for c in clients], dtype=float)
    shapes /= shapes.mean(axis=1, keepdims=True)
    cvs = np.array([c["iat_cv"] for c in clients])
    order = np.argsort(rates, kind="stable")
    return _Library(rates[order], shapes[order], 3600.0, cvs[order])


def _popularity(rng: np.random.Generator, rates: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n rates drawn from the empirical distribution of `rates` (sorted), log-linear between
    neighbouring ranks, and the index of the nearest rank of each."""
    position = rng.random(n) * (len(rates) - 1)
    lo = np.floor(position).astype(np.int64)
    hi = np.minimum(lo + 1, len(rates) - 1)
    w = position - lo
    drawn = np.exp((1 - w) * np.log(rates[lo]) + w * np.log(rates[hi]))
    return drawn, np.where(w < 0.5, lo, hi)


def _services(rng: np.random.Generator, popularity: np.ndarray) -> np.ndarray:
    service = (rng.random(len(popularity)) < _CONV_SHARE).astype(np.int8)
    ranked = np.argsort(-popularity, kind="stable")
    service[ranked[0]] = 1
    if len(ranked) > 1:
        service[ranked[1]] = 0
    return service


def _plan(config: WorkloadConfig, models: list[SimModel], fit: dict) -> _Plan:
    setup = np.random.default_rng(np.random.SeedSequence([config.seed, 1]))
    library = _servegen_library(fit) if config.source == "servegen" else _functions_library(fit)
    n = len(models)
    drawn, nearest = _popularity(setup, library.rates, n)
    num_bins = math.ceil(config.hours * 3600 / library.bin_s - 1e-9)
    segment_bins = library.shapes.shape[1]
    segments = math.ceil(num_bins / segment_bins)
    offsets = setup.integers(-NEIGHBOUR_RANKS, NEIGHBOUR_RANKS + 1, size=(n, segments))
    segment_functions = np.clip(nearest[:, None] + offsets, 0, len(library.rates) - 1)
    target = config.requests_per_model_per_hour or DEFAULT_REQUESTS_PER_MODEL_PER_HOUR
    rate_per_bin = drawn * (target * library.bin_s / 3600 / drawn.mean())
    if config.arrival_process == "poisson":
        cv = np.ones(n)
    elif library.cvs is not None:
        cv = library.cvs[nearest]
    else:
        table = np.array(fit["servegen"]["iat_cv_percentiles"])
        cv = np.interp(setup.random(n) * 100, np.arange(101), table)
    shape_k = 1.0 / np.clip(cv, *CV_RANGE) ** 2
    return _Plan(library, rate_per_bin, segment_functions, shape_k, _services(setup, drawn), num_bins)


def expected_requests_per_hour(config: WorkloadConfig, models: list[SimModel]) -> dict[str, float]:
    """Each model's mean rate (requests/hour) over the run, as the generator's intensity gives it:
    what `generate_workload` produces in expectation (not for source 'azure_llm')."""
    if config.source == "azure_llm":
        raise ValueError("expected_requests_per_hour covers the generated sources; 'azure_llm' replays rows: "
                         "count them with summarize_workload(generate_workload(...))")
    _check_models(models, config)
    plan = _plan(config, models, _fit(config))
    segment_bins = plan.library.shapes.shape[1]
    total = np.zeros(len(models))
    for start in range(0, plan.num_bins, segment_bins):
        stop = min(plan.num_bins, start + segment_bins)
        rows = plan.library.shapes[plan.segment_functions[:, start // segment_bins], : stop - start]
        total += rows.sum(axis=1, dtype=np.float64)
    per_hour = total * plan.model_rate_per_bin / (plan.num_bins * plan.library.bin_s / 3600)
    return {m.model_id: float(r) for m, r in zip(models, per_hour)}


def model_services(config: WorkloadConfig, models: list[SimModel]) -> dict[str, str]:
    """The Azure LLM service ("code" or "conv") whose token counts each model's requests draw."""
    _check_models(models, config)
    fit = _fit(config)
    if config.source == "azure_llm":
        setup = np.random.default_rng(np.random.SeedSequence([config.seed, 1]))
        popularity, _ = _popularity(setup, _functions_library(fit).rates, len(models))
        service = _services(setup, popularity)
    else:
        service = _plan(config, models, fit).service
    return {m.model_id: ("conv" if s else "code") for m, s in zip(models, service.tolist())}


def _fit(config: WorkloadConfig) -> dict:
    """The fit sections `config.source` uses (all of them are in the bundled file)."""
    parts = {"azure_functions": ("azure_functions", "servegen", "azure_llm"), "servegen": ("servegen", "azure_llm"),
             "azure_llm": ("azure_functions",)}[config.source]
    return load_trace_fit(config.trace_dir, parts)


def _check_models(models: list[SimModel], config: WorkloadConfig) -> None:
    if len(models) != config.num_models:
        raise ValueError(f"WorkloadConfig.num_models is {config.num_models} but {len(models)} models were given: "
                         f"build the catalog with model_catalog({config.num_models}, seed)")
    if len({m.model_id for m in models}) != len(models):
        raise ValueError("model ids must be unique: two SimModels share an id")


# --- generation ----------------------------------------------------------------------------------


def _token_tables(fit: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    services = fit["azure_llm"]["services"]
    inputs = np.array([services["code"]["input_tokens_quantiles"], services["conv"]["input_tokens_quantiles"]])
    outputs = np.array([services["code"]["output_tokens_quantiles"], services["conv"]["output_tokens_quantiles"]])
    return np.linspace(0, 1, inputs.shape[1]), inputs, outputs


def _draw_tokens(rng: np.random.Generator, service: np.ndarray, probs: np.ndarray, table: np.ndarray) -> np.ndarray:
    u = rng.random(len(service))
    out = np.where(service == 1, np.interp(u, probs, table[1]), np.interp(u, probs, table[0]))
    return np.maximum(1, np.rint(out)).astype(np.int64)


def _positions(rng: np.random.Generator, counts: np.ndarray, shape_k: np.ndarray) -> np.ndarray:
    """Arrival offsets in [0, 1) of a bin for `counts[i]` arrivals of a Gamma(shape_k[i]) renewal
    process each, gaps rescaled to fill the bin (counts[i] + 1 gaps, the last one after the last
    arrival); uniform where shape_k is 1 (Poisson)."""
    reps = counts + 1
    gaps = rng.standard_gamma(np.repeat(shape_k, reps))
    cum = np.cumsum(gaps)
    ends = np.cumsum(reps) - 1
    starts = ends - counts
    before = cum[starts] - gaps[starts]
    total = cum[ends] - before
    total = np.where(total > 0, total, 1.0)
    keep = np.ones(len(gaps), dtype=bool)
    keep[ends] = False
    owner = np.repeat(np.arange(len(counts)), counts)
    return np.minimum((cum[keep] - before[owner]) / total[owner], np.nextafter(1.0, 0.0))


def _generate(config: WorkloadConfig, models: list[SimModel], fit: dict) -> Iterator[SimRequest]:
    plan = _plan(config, models, fit)
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, 2]))
    probs, in_table, out_table = _token_tables(fit)
    ids = [m.model_id for m in models]
    lib = plan.library
    segment_bins = lib.shapes.shape[1]
    end_s = config.hours * 3600
    poisson = config.arrival_process == "poisson"
    for b in range(plan.num_bins):
        rows = plan.segment_functions[:, b // segment_bins]
        lam = plan.model_rate_per_bin * lib.shapes[rows, b % segment_bins]
        counts_all = rng.poisson(lam)
        active = np.flatnonzero(counts_all)
        if active.size == 0:
            continue
        counts = counts_all[active]
        owners = np.repeat(active, counts)
        if poisson:
            offsets = rng.random(owners.size)
        else:
            offsets = _positions(rng, counts, plan.shape_k[active])
        times = b * lib.bin_s + offsets * lib.bin_s
        order = np.argsort(times, kind="stable")
        times, owners = times[order], owners[order]
        if times[-1] >= end_s:
            cut = int(np.searchsorted(times, end_s))
            times, owners = times[:cut], owners[:cut]
        service = plan.service[owners]
        inputs = _draw_tokens(rng, service, probs, in_table).tolist()
        outputs = _draw_tokens(rng, service, probs, out_table).tolist()
        for t, m, i, o in zip(times.tolist(), owners.tolist(), inputs, outputs):
            yield SimRequest(t, ids[m], i, o)


def _replay_llm(config: WorkloadConfig, models: list[SimModel], fit: dict) -> Iterator[SimRequest]:
    with gzip.open(config.trace_dir / LLM_FILE, "rt", newline="") as f:
        reader = csv.DictReader(f)
        rows = [(float(r["arrival_s"]), r["service"] == "conv", int(r["input_tokens"]), int(r["output_tokens"]))
                for r in reader]
    times = np.array([r[0] for r in rows])
    conv = np.array([r[1] for r in rows])
    inputs = np.array([r[2] for r in rows])
    outputs = np.array([r[3] for r in rows])
    period_s = math.ceil(times[-1] + 1)
    setup = np.random.default_rng(np.random.SeedSequence([config.seed, 1]))
    popularity, _ = _popularity(setup, _functions_library(fit).rates, len(models))
    service = _services(setup, popularity)
    groups = []
    for s in (0, 1):
        members = np.flatnonzero(service == s)
        if members.size == 0:  # one model only: it serves both services
            members = np.arange(len(models))
        groups.append((members, popularity[members] / popularity[members].sum()))
    recorded_per_hour = len(rows) / period_s * 3600
    scale = 1.0 if config.requests_per_model_per_hour is None else \
        config.requests_per_model_per_hour * len(models) / recorded_per_hour
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, 2]))
    ids = [m.model_id for m in models]
    end_s = config.hours * 3600
    for k in range(math.ceil(end_s / period_s)):
        copies = np.floor(scale).astype(np.int64) + (rng.random(len(rows)) < scale - math.floor(scale))
        idx = np.repeat(np.arange(len(rows)), copies)
        t = times[idx] + k * period_s
        idx, t = idx[t < end_s], t[t < end_s]
        owner = np.empty(len(idx), dtype=np.int64)
        for s, (members, weights) in enumerate(groups):
            mask = conv[idx] == bool(s)
            owner[mask] = rng.choice(members, size=int(mask.sum()), p=weights)
        for ti, m, i, o in zip(t.tolist(), owner.tolist(), inputs[idx].tolist(), outputs[idx].tolist()):
            yield SimRequest(ti, ids[m], i, o)


def generate_workload(config: WorkloadConfig, models: list[SimModel]) -> Iterator[SimRequest]:
    """The requests of `config` for `models` (the catalog, in its order), sorted by arrival_s,
    generated lazily. Deterministic for a given config and catalog. Raises ValueError at once
    (before the first request) for a catalog that does not match the config or missing traces."""
    _check_models(models, config)
    if config.source == "azure_llm" and not (config.trace_dir / LLM_FILE).is_file():
        raise ValueError(f"{config.trace_dir / LLM_FILE} not found: set trace_dir (--trace-dir) to the folder "
                         f"holding {LLM_FILE} (../shared/traces)")
    fit = _fit(config)
    if config.source == "azure_llm":
        return _replay_llm(config, models, fit)
    return _generate(config, models, fit)
