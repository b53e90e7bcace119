"""One rank's telemetry while it trains: a sampler thread off the step's path, and the energy of the measured steps,
read from the device's total-energy counter (NVML's; RAPL's packages on a CPU rank) at the bounds of each stretch of
measured steps. A query the device does not answer is left out with its reason, once.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any

from gems.telemetry import node_name, nvml
from gems.telemetry.rapl import Rapl


class _GpuMeter:
    """A GPU (or MIG instance) read through NVML."""

    source = "nvml"

    def __init__(self, gpu: nvml.Gpu) -> None:
        self.gpu = gpu
        self.left_out: dict[str, str] = {}
        lib: Any = nvml.library()  # started: the rank found its GPU through it
        self._sm, self._mem, self._sensor = lib.NVML_CLOCK_SM, lib.NVML_CLOCK_MEM, lib.NVML_TEMPERATURE_GPU
        limit = self._ask("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit")
        self.limit_w = None if limit is None else limit / 1000.0

    @property
    def meter(self) -> str:
        return self.gpu.uuid

    def _ask(self, what: str, query: str, *args: Any) -> Any:
        if what in self.left_out:
            return None
        got = nvml.ask(self.gpu, query, *args)
        if got.why is not None:
            self.left_out[what] = got.why
        return got.value

    def energy_j(self) -> float | None:
        mj = self._ask("energy", "nvmlDeviceGetTotalEnergyConsumption")
        return None if mj is None else mj / 1000.0

    def sample(self) -> dict[str, Any]:
        s: dict[str, Any] = {}
        mw = self._ask("power", "nvmlDeviceGetPowerUsage")
        s["w"] = None if mw is None else mw / 1000.0
        s["sm_mhz"] = self._ask("sm_clock", "nvmlDeviceGetClockInfo", self._sm)
        s["mem_mhz"] = self._ask("mem_clock", "nvmlDeviceGetClockInfo", self._mem)
        if "throttle" not in self.left_out:
            mask = nvml.throttle_mask(self.gpu)
            if mask.why is not None:
                self.left_out["throttle"] = mask.why
            s["reasons"] = mask.value
        s["temp_c"] = self._ask("temperature", "nvmlDeviceGetTemperature", self._sensor)
        util = self._ask("utilization", "nvmlDeviceGetUtilizationRates")
        s["util"] = None if util is None else int(util.gpu)
        mem = self._ask("memory", "nvmlDeviceGetMemoryInfo")
        s["used"] = None if mem is None else int(mem.used)
        procs = self._ask("process_memory", "nvmlDeviceGetComputeRunningProcesses")
        own = [p.usedGpuMemory for p in procs or [] if int(p.pid) == os.getpid() and p.usedGpuMemory is not None]
        s["own"] = int(own[0]) if own else None
        return s


class _CpuMeter:
    """A CPU rank's node, its packages read through RAPL (their power from the energy between two samples)."""

    source = "rapl"

    def __init__(self) -> None:
        self.rapl = Rapl()
        self.left_out: dict[str, str] = {"energy": self.rapl.why} if self.rapl.why else {}
        self.limit_w = None
        self._last: tuple[float, float] | None = None

    @property
    def meter(self) -> str:
        return f"rapl@{node_name()}"  # every rank of the node reads the same packages

    def energy_j(self) -> float | None:
        return self.rapl.read()

    def sample(self) -> dict[str, Any]:
        j, t = self.rapl.read(), time.monotonic()
        w = None
        if j is not None and self._last is not None and t > self._last[1]:
            w = (j - self._last[0]) / (t - self._last[1])
        self._last = (j, t) if j is not None else None
        return {"w": w}


class _Figures:
    """What the samples taken during measured steps add up to."""

    def __init__(self) -> None:
        self.n = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.peaks: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.throttle_s: dict[str, float] = {}

    def add(self, s: dict[str, Any], dt: float) -> None:
        self.n += 1
        for k in ("w", "sm_mhz", "mem_mhz", "temp_c", "util", "used", "own"):
            v = s.get(k)
            if v is None:
                continue
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
            self.counts[k] = self.counts.get(k, 0) + 1
            self.peaks[k] = max(self.peaks.get(k, float(v)), float(v))
            self.mins[k] = min(self.mins.get(k, float(v)), float(v))
        if s.get("reasons") is not None:
            for words in nvml.reasons(int(s["reasons"])):
                if words != "idle":
                    self.throttle_s[words] = self.throttle_s.get(words, 0.0) + dt

    def mean(self, k: str) -> float | None:
        return self.sums[k] / self.counts[k] if self.counts.get(k) else None


class RankTelemetry:
    """One rank's sampler and energy meter. ``device_index``: the rank's GPU as torch numbers it, or None on a CPU
    rank; ``interval_s``: the sampler's period (None: no sampler, the energy still metered).

    The loop calls :meth:`start`, then :meth:`step_began` and :meth:`step_ended` around every step, :meth:`stop` on
    every way out, and hands :meth:`summary` (with :meth:`trace`) to rank 0 for gems.telemetry.figures.combine. The
    energy is read on the rank's thread, one read a measured step and one more a stretch. The sampler, a daemon
    thread, reads power, SM and memory clocks, throttle reasons, temperature, utilisation and memory used (the
    GPU's and this process's) every ``interval_s``: what it reads during measured steps makes the figures,
    everything it reads the trace (at most ``trace_points`` samples: past that, every other one is dropped and the
    rest kept at half the rate)."""

    def __init__(self, device_index: int | None, rank: int, interval_s: float | None = 0.25,
                 trace_points: int = 2000) -> None:
        self.device_index, self.rank = device_index, rank
        self.interval_s, self.trace_points = interval_s, max(2, int(trace_points))
        self.host = node_name()
        self._meter: _GpuMeter | _CpuMeter | None = None
        self._why: str | None = None  # why nothing is metered
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._step, self._measured = -1, False
        self._figures = _Figures()
        self._latest: dict[str, Any] = {}
        self._trace: list[list[Any]] = []
        self._stride, self._seen = 1, 0
        self._bound: tuple[float, float] | None = None  # (energy J, time) at the open stretch's last read
        self._energy, self._metered_s = 0.0, 0.0
        self._steps, self._samples, self._seconds = 0, 0, 0.0
        self._times: list[float] = []

    # ------------------------------------------------------------------------- the loop's calls
    def start(self) -> None:
        """Find the device's meter and start the sampler (a daemon thread)."""
        if self.device_index is None:
            cpu = _CpuMeter()
            if cpu.rapl.why is None:
                self._meter = cpu
            else:
                self._why = f"the CPU ranks' energy is not measured: {cpu.rapl.why}"
                if self.rank == 0:
                    _say_once(self._why)
        elif nvml.library() is None:
            self._why = f"no NVML here ({nvml.absent()})"
            if self.rank == 0:
                nvml.note_absent("the GPUs' power, energy and clocks are not measured")
        else:
            gpu = nvml.gpu_of(self.device_index, _torch_uuid(self.device_index))
            if gpu is None:
                self._why = f"NVML shows no GPU for cuda:{self.device_index}"
            else:
                self._meter = _GpuMeter(gpu)
        self._t0 = time.monotonic()
        if self._meter is not None and self.interval_s:
            self._thread = threading.Thread(target=self._run, name=f"gems-telemetry-{self.rank}", daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    def step_began(self, step: int, measured: bool) -> None:
        """Step ``step`` starts; ``measured``: it counts in the run's figures. A stretch of measured steps opens
        with a read of the energy counter."""
        with self._lock:
            self._step, self._measured = step, measured
            opening = measured and self._bound is None
            if not measured:
                self._bound = None
        if opening and self._meter is not None:
            e = self._meter.energy_j()
            if e is not None:
                self._bound = (e, time.monotonic())

    def step_ended(self, step: int, seconds: float, samples: int, measured: bool | None = None) -> None:
        """Step ``step`` ended: ``seconds`` the rank's own time for it (its waits for peers left out, where the loop
        can tell: the straggler scores compare them), ``samples`` the samples it trained (the global batch);
        ``measured``: whether it counts (default: as :meth:`step_began` last said; a step read a step late, after its
        successor began, says its own)."""
        if not (self._measured if measured is None else measured):
            return
        e = self._meter.energy_j() if self._meter is not None and self._bound is not None else None
        with self._lock:
            if e is not None and self._bound is not None:
                now = time.monotonic()
                self._energy += e - self._bound[0]
                self._metered_s += now - self._bound[1]
                self._bound = (e, now)
            self._steps += 1
            self._samples += int(samples)
            self._seconds += float(seconds)
            self._times.append(float(seconds))

    def stop(self) -> None:
        """Stop the sampler: at once, whatever ended the run (it never holds the rank's exit past a second)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=1.0)
            atexit.unregister(self.stop)

    # ------------------------------------------------------------------------- the sampler
    def _run(self) -> None:
        last = time.monotonic()
        while True:
            try:
                s = self._meter.sample() if self._meter is not None else {}
            except Exception as e:  # a device that went away: the sampler ends, the run goes on
                self._why = f"the sampler stopped: {type(e).__name__}: {e}"
                return
            now = time.monotonic()
            self._take(s, now, now - last)
            last = now
            if self._stop.wait(self.interval_s or 1.0):
                return

    def _take(self, s: dict[str, Any], now: float, dt: float) -> None:
        with self._lock:
            self._latest = s
            if self._measured:
                self._figures.add(s, dt)
            if self._seen % self._stride == 0:
                self._trace.append([round(now - self._t0, 3), self._step, s.get("w"), s.get("sm_mhz")])
                if len(self._trace) >= self.trace_points:
                    self._trace, self._stride = self._trace[::2], self._stride * 2
            self._seen += 1

    # ------------------------------------------------------------------------- what it says
    def metered(self) -> bool:
        """Whether anything is metered (started, on a GPU NVML shows, or a CPU rank)."""
        return self._meter is not None

    def read(self) -> dict[str, Any]:
        """One sample now, as the sampler takes it (what ``gems bench telemetry`` times); empty where nothing is
        metered."""
        return self._meter.sample() if self._meter is not None else {}

    def step_times(self) -> list[float]:
        """The measured steps' times, as :meth:`step_ended` was given them."""
        with self._lock:
            return list(self._times)

    def trace(self) -> list[list[Any]]:
        """The samples for the plot: ``[seconds since start, step, W, SM MHz]`` each (None where not read)."""
        with self._lock:
            return [list(t) for t in self._trace]

    def describe_now(self) -> str:
        """The device's latest reading in words, for a stall's or a straggler's report: "SM clock 1155 MHz, hardware
        thermal slowdown, 87 C, 100% busy"."""
        with self._lock:
            s = dict(self._latest)
        if self._meter is None:
            return self._why or "not measured"
        return words(s) or "no reading yet"

    def summary(self) -> dict[str, Any]:
        """This rank's figures over its measured steps (JSON-ready; a figure left out is absent, its reason in
        ``left_out``)."""
        with self._lock:
            f, energy, metered_s = self._figures, self._energy, self._metered_s
            out: dict[str, Any] = {"rank": self.rank, "host": self.host, "steps": self._steps,
                                   "samples": self._samples, "seconds": self._seconds, "step_times_s": list(self._times)}
        m = self._meter
        if m is None:
            return {**out, "source": None, "device": "cpu" if self.device_index is None else f"cuda:{self.device_index}",
                    "left_out": {"everything": self._why or "not measured"}}
        out.update(source=m.source, meter=m.meter, device="cpu" if self.device_index is None else
                   f"cuda:{self.device_index}", power_limit_w=m.limit_w, samples_read=f.n, samples_taken=self._seen)
        if isinstance(m, _GpuMeter):
            out.update(gpu=m.gpu.name, uuid=m.gpu.uuid, gpu_index=m.gpu.index, mig=m.gpu.mig)
        left = dict(m.left_out)
        if "energy" not in left and metered_s > 0:
            out.update(energy_j=energy, metered_s=metered_s)
            if self._steps:
                out["j_per_step"] = energy / self._steps
            if self._samples:
                out["j_per_sample"] = energy / self._samples
        elif "energy" not in left:
            left["energy"] = "no measured step was metered"
        out["power_w"] = _drop_none({"mean": energy / metered_s if "energy_j" in out else f.mean("w"),
                                     "mean_from": "energy" if "energy_j" in out else "samples",
                                     "peak": f.peaks.get("w")})
        out.update(_drop_none({
            "sm_clock_mhz": _drop_none({"mean": f.mean("sm_mhz"), "min": f.mins.get("sm_mhz")}) or None,
            "mem_clock_mhz": _drop_none({"mean": f.mean("mem_mhz")}) or None,
            "throttle_s": dict(f.throttle_s) if "throttle" not in left and f.n else None,
            "temperature_c": _drop_none({"peak": f.peaks.get("temp_c")}) or None,
            "utilization_pct": _drop_none({"mean": f.mean("util")}) or None,
            "memory_bytes": _drop_none({"nvml_used_peak": f.peaks.get("used"), "process_peak": f.peaks.get("own"),
                                        "torch_reserved_peak": _torch_reserved(self.device_index)}) or None,
        }))
        out["left_out"] = left
        return out


_SAID: set[str] = set()


def _say_once(text: str) -> None:
    """A note on stderr, once a process."""
    if text not in _SAID:
        _SAID.add(text)
        print(f"gems: note: {text}", file=sys.stderr, flush=True)


def words(s: dict[str, Any]) -> str:
    """A reading in words: clock, throttle reasons but idle, temperature, utilisation, power."""
    parts = []
    if s.get("sm_mhz") is not None:
        parts.append(f"SM clock {int(s['sm_mhz'])} MHz")
    parts += [r for r in nvml.reasons(int(s["reasons"])) if r != "idle"] if s.get("reasons") is not None else []
    if s.get("temp_c") is not None:
        parts.append(f"{int(s['temp_c'])} C")
    if s.get("util") is not None:
        parts.append(f"{int(s['util'])}% busy")
    if s.get("w") is not None:
        parts.append(f"{float(s['w']):.0f} W")
    return ", ".join(parts)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _torch_uuid(index: int) -> str | None:
    """The UUID torch reports for ``cuda:<index>`` (where its build has one)."""
    try:
        import torch

        return str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "") or None
    except Exception:  # no CUDA in this torch, or the device is not there: NVML's own order
        return None


def _torch_reserved(index: int | None) -> int | None:
    """The most torch's caching allocator reserved on ``cuda:<index>`` (None on CPU ranks)."""
    if index is None:
        return None
    try:
        import torch

        return int(torch.cuda.max_memory_reserved(index)) if torch.cuda.is_initialized() else None
    except Exception:
        return None


__all__ = ["RankTelemetry", "words"]
