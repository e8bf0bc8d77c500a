"""The GPU suite's markdown table, built from its JSON lines: pure functions of plain dicts.

`summary_table` takes the suite's step records (one per step: name, status, seconds, a detail
such as pytest's counts) and every JSON line the steps printed (each tagged with its ``step``),
and returns one table: a row per step, then a row per figure line of that step with what was
measured for us, for the peer, their ratio and whether the target was met.

How a line becomes a figure row (`figure_of`), most specific first:

* a pytest line (the suite's, from the JUnit report): the ids of failed tests, if any;
* a ``skipped`` line: what was skipped and why;
* a ``summary`` dict (the convention of `bench/engine_gpu.py` and `bench/coldstart_gpu.py`):
  ``case``, ``ours``, ``peer``, ``ratio``, ``target_met`` as they are;
* a `bench/kernels.py` line (``thaw_gbps``): GB/s, share of HBM peak, SDPA's GB/s;
* a `bench/loader_gpu.py` line: ours and the peer's GB/s (a peer's line), or ours against the
  limit with every peer's rate, the smallest of our ratios to them and both targets (our line);
* anything else: the first identifying fields as the case,
  the first known figure as ours, the first ``ratio*`` field, ``target_met``/``meets_targets``.
"""

from __future__ import annotations

from dataclasses import dataclass

HEADER = ("| step | status | time, s | case | ours | peer | ratio | target met |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
MAX_CELL_CHARS = 160
CASE_KEYS = ("case", "loader", "peer", "source", "tier", "state", "method")
FIGURE_KEYS = (("gbps", "GB/s"), ("tokens_per_s", "tok/s"), ("ttft_s", "s"), ("seconds", "s"), ("load_s", "s"))


@dataclass(frozen=True)
class Figure:
    """One table row's measured part (cells as text)."""

    case: str
    ours: str = ""
    peer: str = ""
    ratio: float | None = None
    target_met: bool | None = None


def _cell(text: str) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS - 3] + "..."


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _target(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def figure_of(line: dict) -> Figure | None:
    """The figure row of one JSON line (see the module docstring for the rules); None for a
    pytest line with nothing failed (its counts are in the step's row)."""
    name = next((str(line[k]) for k in CASE_KEYS if line.get(k) not in (None, "")), "")
    if line.get("bench") == "pytest":
        failed = line.get("failed_ids") or []
        return Figure("failed: " + ", ".join(failed)) if failed else None
    if isinstance(line.get("skipped"), str):
        return Figure(f"{name}: skipped ({line['skipped']})" if name else f"skipped ({line['skipped']})")
    if isinstance(line.get("summary"), dict):
        s = line["summary"]
        return Figure(str(s.get("case", name)), str(s.get("ours", "")), str(s.get("peer", "")),
                      s.get("ratio"), s.get("target_met"))
    if line.get("bench") == "loader_gpu" and _number(line.get("gbps")):
        return _loader_figure(line)
    if str(line.get("bench", "")).startswith("kernels") and _number(line.get("thaw_gbps")):
        case = f"decode attention B={line.get('batch')} ctx={line.get('context')}"
        if "block_n" in line:
            case += f" block_n={line['block_n']} warps={line.get('num_warps')} stages={line.get('num_stages')}"
        fraction = line.get("thaw_peak_fraction")
        ours = f"{line['thaw_gbps']:.0f} GB/s" + (f" ({fraction:.0%} of peak)" if _number(fraction) else "")
        peer = f"{line['sdpa_gathered_gbps']:.0f} GB/s (SDPA, gathered K/V)" if _number(
            line.get("sdpa_gathered_gbps")) else ""
        target = line.get("target_peak_fraction")
        met = fraction >= target if _number(target) and _number(fraction) else None
        return Figure(case, ours, peer, line.get("ratio"), met)
    case = " ".join(str(line[k]) for k in CASE_KEYS if line.get(k) not in (None, "")) or str(line.get("bench", ""))
    ours = next((f"{line[k]:g} {unit}" for k, unit in FIGURE_KEYS if _number(line.get(k))), "")
    ratio = next((line[k] for k in sorted(line) if k.startswith("ratio") and _number(line[k])), None)
    met = line.get("target_met", line.get("meets_targets"))
    return Figure(case, ours, "", ratio, met if isinstance(met, bool) else None)


def _loader_figure(line: dict) -> Figure:
    """`bench/loader_gpu.py`: a peer's line has ``ratio_thaw_to_this``; our default loader's line
    has the limit, the peers' rates and a ``target`` dict; others (raw read, link) only a rate."""
    case = f"{line.get('source', '')}: {line.get('loader', '')}".strip(": ")
    gbps, ours = line["gbps"], line.get("thaw_gbps")
    if "ratio_thaw_to_this" in line:
        return Figure(case, f"{ours:g} GB/s" if _number(ours) else "", f"{gbps:g} GB/s",
                      line["ratio_thaw_to_this"] if _number(line["ratio_thaw_to_this"]) else None)
    target = line.get("target")
    if not isinstance(target, dict):
        return Figure(case, f"{gbps:g} GB/s")
    fraction, limit = line.get("fraction_of_limit"), line.get("limit_gbps")
    ours = f"{gbps:g} GB/s" + (f" ({fraction:.0%} of {limit:g} GB/s limit)" if _number(fraction) and _number(limit)
                               else "")
    peers = line.get("peers_gbps") if isinstance(line.get("peers_gbps"), dict) else {}
    ratios = [r for r in (line.get("ratio_thaw_to_peer") or {}).values() if _number(r)]
    met = target.get("meets_fraction"), target.get("faster_than_each_peer")
    return Figure(case, ours, ", ".join(f"{p} {g:g} GB/s" for p, g in peers.items() if _number(g)),
                  min(ratios) if ratios else None, all(met) if all(isinstance(m, bool) for m in met) else None)


def summary_table(records: list[dict], lines: list[dict]) -> str:
    """The markdown table: per record (in order), its step row, then its lines' figure rows."""
    rows = [HEADER]
    for record in records:
        step = record["step"]
        seconds = record.get("duration_s")
        rows.append(f"| {_cell(step)} | {_cell(record.get('status', ''))} | "
                    f"{'—' if seconds is None else f'{seconds:.1f}'} | {_cell(record.get('detail', ''))} |  |  |  |  |")
        for line in lines:
            f = figure_of(line) if line.get("step") == step else None
            if f is not None:
                rows.append(f"|  |  |  | {_cell(f.case)} | {_cell(f.ours)} | {_cell(f.peer)} | {_ratio(f.ratio)} | "
                            f"{_target(f.target_met)} |")
    return "\n".join(rows) + "\n"
