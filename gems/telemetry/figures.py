"""The record's ``telemetry`` section (its keys: docs/studies.md, "Energy, power and clocks") from every rank's
:meth:`~gems.telemetry.rank.RankTelemetry.summary`, and the straggler scores. Ranks that read one meter (a CPU
node's RAPL packages) count it once: a figure summed over the run is summed over meters, not ranks.
"""
from __future__ import annotations

import statistics
from typing import Any

#: a rank whose windows average this close to the fastest rank's is no straggler
STRAGGLER = 0.95


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _ranks(ranks: list[int]) -> str:
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs[:8]) + (" ..." if len(rs) > 8 else "")


def cause(summary: dict[str, Any]) -> str:
    """What a rank's summary says of its pace: its SM clock, the throttle reasons it met and for how long, its peak
    temperature and utilisation ("SM clock 1155 MHz (min 1005), hardware thermal slowdown 12.0 s, 87 C")."""
    parts = []
    sm = summary.get("sm_clock_mhz") or {}
    if sm.get("mean") is not None:
        parts.append(f"SM clock {sm['mean']:.0f} MHz" + (f" (min {sm['min']:.0f})" if sm.get("min") is not None
                                                         and sm["min"] < sm["mean"] - 1 else ""))
    for reason, s in sorted((summary.get("throttle_s") or {}).items(), key=lambda kv: -kv[1]):
        parts.append(f"{reason} {s:.1f} s")
    t = (summary.get("temperature_c") or {}).get("peak")
    if t is not None:
        parts.append(f"{t:.0f} C")
    u = (summary.get("utilization_pct") or {}).get("mean")
    if u is not None:
        parts.append(f"{u:.0f}% busy")
    return ", ".join(parts)


def where(summary: dict[str, Any]) -> str:
    """A rank's place: ``nid001234 GPU 2``, or its host alone on a CPU rank."""
    host = summary.get("host") or "?"
    return f"{host} GPU {summary['gpu_index']}" if summary.get("gpu_index") is not None else str(host)


def stragglers(step_times: list[list[float]], window: int = 10, places: list[str] | None = None,
               causes: list[str] | None = None) -> dict[str, Any] | None:
    """Each rank's score in each window of ``window`` steps (nvidia-resiliency-ext's two scores): the best rank's
    time over the window against its own (``relative``), and its own best window's against it (``own``); 1 is the
    best. The slowest rank (the lowest mean relative score) is named in ``words`` with its place and cause, where
    given. None with fewer than two ranks or no step."""
    n = min((len(t) for t in step_times), default=0)
    if len(step_times) < 2 or n == 0:
        return None
    spans = [range(a, min(a + window, n)) for a in range(0, n, window)]
    per = [[sum(t[i] for i in span) for span in spans] for t in step_times]
    best = [min(p[w] for p in per) for w in range(len(spans))]
    relative = [[best[w] / p[w] if p[w] > 0 else 1.0 for w in range(len(spans))] for p in per]
    own = [[min(p) / p[w] if p[w] > 0 else 1.0 for w in range(len(spans))] for p in per]
    means = [statistics.fmean(r) for r in relative]
    slow = min(range(len(means)), key=lambda r: means[r])
    if means[slow] >= STRAGGLER:
        text = f"no straggler: every rank within {100 * (1 - STRAGGLER):.0f}% of the fastest (the slowest, rank {slow}, " \
               f"at {means[slow]:.2f})"
    else:
        text = f"rank {slow}" + (f", {places[slow]}" if places else "") + f", at {means[slow]:.2f} of the fastest rank"
        text += f": {causes[slow]}" if causes and causes[slow] else ""
    return {"window_steps": window, "windows": len(spans),
            "relative": [[round(x, 4) for x in r] for r in relative], "own": [[round(x, 4) for x in r] for r in own],
            "slowest": {"rank": slow, "score": round(means[slow], 4), "words": text}}


def _memory(per: list[dict[str, Any]]) -> dict[str, Any] | None:
    """NVML's peak beside torch's on the rank where NVML saw the most, and the difference named."""
    seen = [s for s in per if (s.get("memory_bytes") or {}).get("nvml_used_peak") is not None]
    if not seen:
        return None
    top = max(seen, key=lambda s: s["memory_bytes"]["nvml_used_peak"])
    m = top["memory_bytes"]
    out: dict[str, Any] = {"rank": top["rank"], "nvml_used_peak_bytes": int(m["nvml_used_peak"])}
    if m.get("torch_reserved_peak") is not None:
        out["torch_reserved_peak_bytes"] = int(m["torch_reserved_peak"])
        out["difference_bytes"] = out["nvml_used_peak_bytes"] - out["torch_reserved_peak_bytes"]
    if m.get("process_peak") is not None:
        out["other_processes_bytes"] = max(0, int(m["nvml_used_peak"]) - int(m["process_peak"]))
        if m.get("torch_reserved_peak") is not None:
            out["context_nccl_bytes"] = max(0, int(m["process_peak"]) - int(m["torch_reserved_peak"]))
    return out


def _left_out(per: list[dict[str, Any]]) -> dict[str, str]:
    """Each figure some rank left out: its reason and the ranks (one line, however many ranks)."""
    by: dict[tuple[str, str], list[int]] = {}
    for s in per:
        for what, why in (s.get("left_out") or {}).items():
            by.setdefault((what, why), []).append(int(s["rank"]))
    out: dict[str, str] = {}
    for (what, why), ranks in by.items():
        text = f"{why} ({_ranks(ranks)})"
        out[what] = f"{out[what]}; {text}" if what in out else text
    return out


def combine(per_rank: list[dict[str, Any]], global_batch: int, measured_steps: int,
            window: int = 10) -> dict[str, Any]:
    """The record's ``telemetry`` section (docs/studies.md) from every rank's summary (each with its ``trace``,
    where the plot is wanted), the run's global batch and its measured steps."""
    per = sorted((dict(s) for s in per_rank), key=lambda s: int(s["rank"]))
    traces = {str(s["rank"]): s.pop("trace") for s in per if s.get("trace")}
    times = [s.pop("step_times_s", None) or [] for s in per]
    meters: dict[str, dict[str, Any]] = {}
    for s in per:
        if s.get("meter"):
            meters.setdefault(str(s["meter"]), s)
    sources = sorted({str(s["source"]) for s in per if s.get("source")})
    out: dict[str, Any] = {"source": "+".join(sources) or None, "measured_steps": measured_steps,
                           "global_batch": global_batch, "devices": len(meters)}
    left = _left_out(per)
    if meters and all(m.get("energy_j") is not None for m in meters.values()):
        energy = sum(float(m["energy_j"]) for m in meters.values())
        out["energy_j"] = energy
        if measured_steps:
            out["j_per_step"] = energy / measured_steps
            out["j_per_sample"] = energy / (global_batch * measured_steps) if global_batch else None
    elif not meters:
        left.setdefault("energy", "no rank was metered")
    watts = [float(m["power_w"]["mean"]) for m in meters.values() if (m.get("power_w") or {}).get("mean") is not None]
    if watts:
        out["w_per_device"] = statistics.fmean(watts)
    figures = {
        "power_w_peak": max([s["power_w"]["peak"] for s in per if (s.get("power_w") or {}).get("peak")], default=None),
        "power_limit_w": max([s["power_limit_w"] for s in per if s.get("power_limit_w")], default=None),
        "temperature_c_peak": max([s["temperature_c"]["peak"] for s in per if s.get("temperature_c")], default=None),
        "utilization_pct_mean": _mean([s["utilization_pct"]["mean"] for s in per if s.get("utilization_pct")]),
        "memory": _memory(per),
    }
    clocks = [s["sm_clock_mhz"] for s in per if (s.get("sm_clock_mhz") or {}).get("mean") is not None]
    if clocks:
        figures["sm_clock_mhz"] = {"mean": statistics.fmean(c["mean"] for c in clocks),
                                   "min": min(c.get("min", c["mean"]) for c in clocks)}
    throttle: dict[str, float] = {}
    for s in per:
        for reason, secs in (s.get("throttle_s") or {}).items():
            throttle[reason] = max(throttle.get(reason, 0.0), float(secs))
    figures["throttle_s"] = throttle if any("throttle_s" in s for s in per) else None
    out.update({k: v for k, v in figures.items() if v is not None})
    found = stragglers(times, window, [where(s) for s in per], [cause(s) for s in per])
    if found is not None:
        out["stragglers"] = found
    out["left_out"] = left
    out["per_rank"] = per
    if traces:
        out["trace"] = traces
    return out


__all__ = ["STRAGGLER", "cause", "combine", "stragglers", "where"]
