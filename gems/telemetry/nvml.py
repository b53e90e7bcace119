"""NVML, through NVIDIA's bindings (``nvidia-ml-py``, module ``pynvml``): the only module of gems that calls them,
imported on first use so a CPU-only machine needs no driver. A query goes through :func:`ask`, which gives its value
or the reason it is left out (``NotSupported``, ``NoPermission``, ...), never a zero; a GPU, or a MIG instance with
its parent, is a :class:`Gpu`.
"""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"lib": None, "why": None, "said": False}

#: NVML's throttle (clock event) reasons: the suffix of ``nvmlClocksEventReason*`` (``nvmlClocksThrottleReason*``
#: before driver 535) and its words
REASONS = (
    ("GpuIdle", "idle"),
    ("ApplicationsClocksSetting", "application clocks setting"),
    ("SwPowerCap", "software power cap"),
    ("HwSlowdown", "hardware slowdown"),
    ("SyncBoost", "sync boost"),
    ("SwThermalSlowdown", "software thermal slowdown"),
    ("HwThermalSlowdown", "hardware thermal slowdown"),
    ("HwPowerBrakeSlowdown", "hardware power brake"),
    ("DisplayClockSetting", "display clock setting"),
)


def library() -> Any | None:
    """``pynvml``, initialised once a process; None where NVML cannot start here (:func:`absent` says why)."""
    with _LOCK:
        if _STATE["lib"] is not None or _STATE["why"] is not None:
            return _STATE["lib"]
        try:
            import pynvml
        except ImportError as e:
            _STATE["why"] = f"the nvidia-ml-py package is not installed ({e})"
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded: a machine without NVIDIA's driver
            _STATE["why"] = f"NVML did not start: {e}"
            return None
        _STATE["lib"] = pynvml
        return pynvml


def absent() -> str | None:
    """Why NVML is not here (None where it is)."""
    library()
    return _STATE["why"]


def note_absent(what: str) -> None:
    """Say once a process that NVML is not here and what goes without it (``what``)."""
    why = absent()
    with _LOCK:
        if why is None or _STATE["said"]:
            return
        _STATE["said"] = True
    print(f"gems: note: no NVML here ({why}): {what}", file=sys.stderr, flush=True)


def forget() -> None:
    """Start NVML afresh at the next :func:`library` (a test that changes the NVML it sees)."""
    with _LOCK:
        lib = _STATE["lib"]
        if lib is not None:
            try:
                lib.nvmlShutdown()
            except lib.NVMLError:
                pass
        _STATE.update(lib=None, why=None, said=False)
    sys.modules.pop("pynvml", None)


class Got(NamedTuple):
    """A query's answer: its value, or None and why it is left out."""

    value: Any
    why: str | None = None


@dataclass
class Gpu:
    """One GPU as NVML sees it (a MIG instance: ``parent`` is its GPU, ``index`` the parent's)."""

    index: int
    handle: Any
    uuid: str
    name: str
    parent: Gpu | None = None

    @property
    def mig(self) -> bool:
        return self.parent is not None

    def where(self) -> str:
        """``GPU 2 (GPU-5a1c...)``, or ``GPU 2 MIG-... `` for an instance."""
        return f"GPU {self.index} ({self.uuid})"


def ask(gpu: Gpu | None, query: str, *args: Any) -> Got:
    """``pynvml.<query>(gpu's handle, *args)`` (``gpu`` None: a system query), or why it is left out."""
    lib = library()
    if lib is None:
        return Got(None, f"no NVML here ({absent()})")
    fn = getattr(lib, query, None)
    if fn is None:
        return Got(None, f"this nvidia-ml-py has no {query}")
    try:
        return Got(fn(gpu.handle, *args) if gpu is not None else fn(*args))
    except lib.NVMLError_NotSupported:
        return Got(None, "not supported on a MIG instance" if gpu is not None and gpu.mig
                   else "not supported by this GPU or driver")
    except lib.NVMLError_NoPermission:
        return Got(None, "needs root (NVML: Insufficient Permissions)")
    except lib.NVMLError as e:
        return Got(None, f"NVML: {e}")


def reason_bits() -> list[tuple[int, str]]:
    """(bit, words) of every throttle reason this pynvml names."""
    lib = library()
    if lib is None:
        return []
    out = []
    for suffix, words in REASONS:
        bit = getattr(lib, f"nvmlClocksEventReason{suffix}", getattr(lib, f"nvmlClocksThrottleReason{suffix}", None))
        if bit is not None:
            out.append((int(bit), words))
    return out


def reasons(mask: int) -> list[str]:
    """The throttle reasons a bitmask holds, in words."""
    return [words for bit, words in reason_bits() if mask & bit]


def throttle_mask(gpu: Gpu) -> Got:
    """The active throttle reasons' bitmask (the clock event reasons since driver 535, the throttle reasons before)."""
    got = ask(gpu, "nvmlDeviceGetCurrentClocksEventReasons")
    if got.why is not None and got.why.startswith("this nvidia-ml-py has no"):
        got = ask(gpu, "nvmlDeviceGetCurrentClocksThrottleReasons")
    return Got(int(got.value), None) if got.why is None else got


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _gpu(index: int, handle: Any, parent: Gpu | None = None) -> Gpu:
    uuid = ask(None, "nvmlDeviceGetUUID", handle)
    name = ask(None, "nvmlDeviceGetName", handle)
    return Gpu(index, handle, _text(uuid.value) if uuid.why is None else f"uuid unknown: {uuid.why}",
               _text(name.value) if name.why is None else (parent.name if parent else "unknown"), parent)


def every_gpu() -> list[Gpu]:
    """Every GPU of the node (whatever this process may use), in NVML's order."""
    count = ask(None, "nvmlDeviceGetCount")
    out = []
    for i in range(int(count.value or 0)):
        h = ask(None, "nvmlDeviceGetHandleByIndex", i)
        if h.why is None:
            out.append(_gpu(i, h.value))
    return out


def instances(gpu: Gpu) -> list[Gpu]:
    """The MIG instances of ``gpu`` (none where MIG is off or not supported)."""
    mode = ask(gpu, "nvmlDeviceGetMigMode")
    lib = library()
    if mode.why is not None or lib is None or not mode.value or int(mode.value[0]) != lib.NVML_DEVICE_MIG_ENABLE:
        return []
    most = ask(gpu, "nvmlDeviceGetMaxMigDeviceCount")
    out = []
    for k in range(int(most.value or 0)):
        h = ask(gpu, "nvmlDeviceGetMigDeviceHandleByIndex", k)
        if h.why is None:
            out.append(_gpu(gpu.index, h.value, gpu))
    return out


def _bare(uuid: str) -> str:
    """A UUID without NVML's ``GPU-``/``MIG-`` prefix, lower case (torch reports them bare)."""
    u = uuid.strip().lower()
    return u.split("-", 1)[1] if u.startswith(("gpu-", "mig-")) else u


def visible() -> list[Gpu]:
    """The GPUs (or MIG instances) this process may use: those ``CUDA_VISIBLE_DEVICES`` names (an NVML index, or a
    UUID or its unique start), every GPU where it is unset."""
    gpus = every_gpu()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return gpus
    every = gpus + [m for g in gpus for m in instances(g)]
    out: list[Gpu] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.isdigit():
            found = [g for g in gpus if g.index == int(entry)]
        else:
            found = [g for g in every if _bare(g.uuid).startswith(_bare(entry)) and entry]
        if len(found) != 1:
            break  # CUDA stops at the first entry it cannot use: so does what it sees
        out.append(found[0])
    return out


def gpu_of(torch_index: int, uuid: str | None = None) -> Gpu | None:
    """The GPU torch calls ``cuda:<torch_index>``: the one of UUID ``uuid`` (torch's own, where its build reports
    it), else the entry of :func:`visible` at that index; None where NVML has none."""
    seen = visible()
    if uuid:
        every = seen + [m for g in seen for m in instances(g)]
        match = [g for g in every if _bare(g.uuid) == _bare(str(uuid))]
        if match:
            return match[0]
    return seen[torch_index] if 0 <= torch_index < len(seen) else None


__all__ = ["Got", "Gpu", "REASONS", "absent", "ask", "every_gpu", "forget", "gpu_of", "instances", "library",
           "note_absent", "reason_bits", "reasons", "throttle_mask", "visible"]
