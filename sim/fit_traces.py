"""Fit the workload generator's parameters from the raw traces, and load them.

    python -m sim.fit_traces --trace-dir ../shared/traces [--out sim/data/trace_fit.json.gz]

reads three files of the trace folder (its README says what each is) and writes the parameters
`sim.workload` draws from, so the simulator runs without the traces (the committed
`sim/data/trace_fit.json.gz`; gzip because the per-minute counts are 470 KB as text):

- `azure_functions`: per function of the Azure Functions 2019 500-function sample, its mean
  invocations per minute (popularity) and its nonzero per-minute counts over the 480 minutes
  (the shape of its rate), as [minute, count] pairs.
- `servegen`: per (model, client) of ServeGen's client windows, its mean request rate over its
  model's span, its mean rate per hour of the day (24 values; missing windows count as zero,
  t = 0 is midnight per the README) and the median of its windows' inter-arrival CV; plus the
  percentiles 0..100 of the inter-arrival CV over all active client-windows.
- `azure_llm`: per service (code, conv) of the Azure LLM 2023 trace, its request count and rate,
  and the quantiles (201 evenly spaced probabilities, linear interpolation) of its input and
  output token counts.

`load_trace_fit(None)` reads the committed file; `load_trace_fit(dir)` refits from `dir` in
memory (about a second).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

__all__ = ["FUNCTIONS_FILE", "SERVEGEN_FILE", "LLM_FILE", "BUNDLED_FIT", "fit_traces", "load_trace_fit", "main"]

FUNCTIONS_FILE = "azure_functions_2019_sample500_invocations.csv.gz"
SERVEGEN_FILE = "servegen_client_windows.csv.gz"
LLM_FILE = "azure_llm_2023_requests.csv.gz"
BUNDLED_FIT = Path(__file__).parent / "data" / "trace_fit.json.gz"
FORMAT = 1
TOKEN_QUANTILES = 201
SERVEGEN_WINDOW_S = 600


def _require(trace_dir: Path, name: str) -> Path:
    path = trace_dir / name
    if not path.is_file():
        raise ValueError(f"trace file {path} not found: point trace_dir (--trace-dir) at the folder of "
                         f"../shared/traces/README.md, or leave it unset to use the bundled fit {BUNDLED_FIT}")
    return path


def _rows(path: Path) -> list[list[str]]:
    with gzip.open(path, "rt", newline="") as f:
        return list(csv.reader(f))


def _fit_functions(path: Path) -> dict:
    rows = _rows(path)
    minutes = len(rows[0]) - 4
    rates, counts, triggers = [], [], []
    for row in rows[1:]:
        per_minute = [int(x) for x in row[4:]]
        rates.append(sum(per_minute) / minutes)
        counts.append([[m, c] for m, c in enumerate(per_minute) if c])
        triggers.append(row[3])
    return {"minutes": minutes, "bin_s": 60, "rates_per_bin": rates, "counts": counts, "triggers": triggers}


def _fit_servegen(path: Path) -> dict:
    rows = _rows(path)
    header = rows[0]
    col = {name: header.index(name) for name in ("model", "client_id", "window_start_s", "rate_rps", "iat_cv")}
    span_s: dict[str, float] = defaultdict(float)
    per_client: dict[tuple[str, str], list[tuple[float, float, float]]] = defaultdict(list)
    all_cv = []
    for row in rows[1:]:
        model, start = row[col["model"]], float(row[col["window_start_s"]])
        rate, cv = float(row[col["rate_rps"]]), float(row[col["iat_cv"]])
        span_s[model] = max(span_s[model], start + SERVEGEN_WINDOW_S)
        per_client[(model, row[col["client_id"]])].append((start, rate, cv))
        all_cv.append(cv)
    clients = []
    for (model, client_id), windows in sorted(per_client.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
        days = span_s[model] / 86400
        hourly = np.zeros(24)
        for start, rate, _ in windows:
            hourly[int(start % 86400) // 3600] += rate * SERVEGEN_WINDOW_S
        hourly /= 3600 * days  # mean req/s in that hour of the day
        mean_rps = float(hourly.mean())
        if mean_rps <= 0:
            continue
        clients.append({"model": model, "client_id": int(client_id), "rate_rps": round(mean_rps, 9),
                        "hourly": [round(float(v / mean_rps), 5) for v in hourly],
                        "iat_cv": round(float(np.median([w[2] for w in windows])), 5)})
    return {"bin_s": 3600, "clients": clients,
            "iat_cv_percentiles": [round(float(v), 5) for v in np.percentile(all_cv, np.arange(101))]}


def _fit_llm(path: Path) -> dict:
    rows = _rows(path)
    header = rows[0]
    i_t, i_s = header.index("arrival_s"), header.index("service")
    i_in, i_out = header.index("input_tokens"), header.index("output_tokens")
    by_service: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
    for row in rows[1:]:
        by_service[row[i_s]].append((float(row[i_t]), int(row[i_in]), int(row[i_out])))
    span_s = max(t for rs in by_service.values() for t, _, _ in rs)
    probs = np.linspace(0, 1, TOKEN_QUANTILES)
    services = {}
    for name, reqs in sorted(by_service.items()):
        inputs = np.array([r[1] for r in reqs], dtype=float)
        outputs = np.array([r[2] for r in reqs], dtype=float)
        services[name] = {"requests": len(reqs), "mean_rps": round(len(reqs) / span_s, 6),
                          "input_tokens_quantiles": [round(float(v), 2) for v in np.quantile(inputs, probs)],
                          "output_tokens_quantiles": [round(float(v), 2) for v in np.quantile(outputs, probs)]}
    return {"span_s": span_s, "services": services}


PARTS = {"azure_functions": (FUNCTIONS_FILE, _fit_functions), "servegen": (SERVEGEN_FILE, _fit_servegen),
         "azure_llm": (LLM_FILE, _fit_llm)}


def fit_traces(trace_dir: Path, parts: tuple[str, ...] = tuple(PARTS)) -> dict:
    """The fitted parameters (the JSON's content) from the raw files in `trace_dir`; only the
    sections named in `parts` (all by default: the servegen one takes most of the time)."""
    trace_dir = Path(trace_dir)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown fit parts {sorted(unknown)}; use some of {list(PARTS)}")
    paths = {part: _require(trace_dir, PARTS[part][0]) for part in parts}
    fit = {"format": FORMAT, "made_by": "python -m sim.fit_traces (see its docstring)",
           "inputs_sha256": {PARTS[part][0]: hashlib.sha256(p.read_bytes()).hexdigest() for part, p in paths.items()}}
    for part, path in paths.items():
        fit[part] = PARTS[part][1](path)
    return fit


def load_trace_fit(trace_dir: Path | None, parts: tuple[str, ...] = tuple(PARTS)) -> dict:
    """The bundled fit when `trace_dir` is None, else a fresh fit of `trace_dir`'s files (only
    the sections in `parts`)."""
    if trace_dir is not None:
        return fit_traces(Path(trace_dir), parts)
    if not BUNDLED_FIT.is_file():
        raise ValueError(f"the bundled trace fit {BUNDLED_FIT} is missing: regenerate it with "
                         f"`python -m sim.fit_traces --trace-dir <traces folder>` or pass trace_dir")
    with gzip.open(BUNDLED_FIT, "rt") as f:
        fit = json.load(f)
    if fit.get("format") != FORMAT:
        raise ValueError(f"{BUNDLED_FIT} has format {fit.get('format')!r}, this code reads {FORMAT}: "
                         f"regenerate it with `python -m sim.fit_traces --trace-dir <traces folder>`")
    return fit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace-dir", type=Path, required=True, help="folder of the raw traces (../shared/traces)")
    parser.add_argument("--out", type=Path, default=BUNDLED_FIT, help=f"where to write (default {BUNDLED_FIT})")
    args = parser.parse_args(argv)
    try:
        fit = fit_traces(args.trace_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(fit, separators=(",", ":"), sort_keys=True).encode()
    with open(args.out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(data)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
