"""A stand-in for NVIDIA's ``pynvml`` (nvidia-ml-py) at the boundary gems calls, for machines without a GPU.

The tests put this folder first on ``sys.path`` and ``PYTHONPATH``. It keeps the names, signatures and documented
behaviour of the functions gems calls (NVML's reference, nvmlDevice* and nvmlSystem*): errors are ``NVMLError``
subclasses made from NVML's return codes (``NVMLError_NotSupported``, ``NVMLError_NoPermission`` ...), a call before
``nvmlInit`` is ``NVMLError_Uninitialized``, a handle outside the count ``NVMLError_InvalidArgument``, the energy
counter is in mJ and only grows (at the GPU's power draw, in wall-clock time), power in mW, memory in bytes,
clocks in MHz, a CUDA driver version as 1000 x major + 10 x minor. A MIG instance answers what NVML answers for one
(its UUID, memory and processes) and ``NotSupported`` for the rest (power, energy, clocks, temperature,
utilisation, throttle reasons, ECC, PCIe).

Its GPUs come from the JSON file ``GEMS_FAKE_NVML`` names: ``{NODE: {...}, "*": {...}}``, the node this process
runs on (``SLURMD_NODENAME``, else the host's name) or ``*``. A node: ``driver`` (a version string), ``cuda``
(e.g. 12040), ``gpus``: a list of GPUs, each with any of ``name``, ``uuid``, ``memory_total``, ``memory_used``,
``power_mw``, ``power_limit_mw``, ``energy_mj`` (the counter at ``t0``, seconds since the epoch), ``sm_mhz``,
``mem_mhz``, ``temp_c``, ``util``, ``reasons`` (the throttle bitmask), ``ecc_uncorrected`` (volatile),
``retired_pending``, ``remap`` ([correctable, uncorrectable, pending, failure]), ``pcie`` ([gen, max gen, width, max
width]), ``processes`` ([[pid or "self", bytes], ...]), ``mig`` ([{"uuid": ..., "memory_total": ...}]),
``not_supported`` and ``root_only`` (the names of functions that answer ``NotSupported``, or ``NoPermission``
unless the caller is root: the node's ``root``, else whether this process runs as root), ``slow`` ({function:
seconds it takes}: a GPU that stopped answering).
Without the file NVML's library is not found (``NVMLError_LibraryNotFound``): a machine without NVIDIA's driver.
"""
from __future__ import annotations

import ctypes
import json
import os
import socket
import string
import sys
import time
from types import SimpleNamespace
from typing import Any

# ---------------------------------------------------------------------------- NVML's constants (nvml.h's values)
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1

nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonApplicationsClocksSetting = 0x2
nvmlClocksEventReasonSwPowerCap = 0x4
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSyncBoost = 0x10
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksEventReasonDisplayClockSetting = 0x100
nvmlClocksEventReasonNone = 0x0
nvmlClocksThrottleReasonGpuIdle = nvmlClocksEventReasonGpuIdle
nvmlClocksThrottleReasonApplicationsClocksSetting = nvmlClocksEventReasonApplicationsClocksSetting
nvmlClocksThrottleReasonSwPowerCap = nvmlClocksEventReasonSwPowerCap
nvmlClocksThrottleReasonHwSlowdown = nvmlClocksEventReasonHwSlowdown
nvmlClocksThrottleReasonSyncBoost = nvmlClocksEventReasonSyncBoost
nvmlClocksThrottleReasonSwThermalSlowdown = nvmlClocksEventReasonSwThermalSlowdown
nvmlClocksThrottleReasonHwThermalSlowdown = nvmlClocksEventReasonHwThermalSlowdown
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = nvmlClocksEventReasonHwPowerBrakeSlowdown
nvmlClocksThrottleReasonDisplayClockSetting = nvmlClocksEventReasonDisplayClockSetting
nvmlClocksThrottleReasonNone = nvmlClocksEventReasonNone

_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized", NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout", NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """NVML's error: ``NVMLError(code)`` is the subclass of that code, as the bindings make it."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value: int) -> Any:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return _STRINGS.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def _classes() -> None:
    """``NVMLError_NotSupported`` and the others, named as the bindings name them."""
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        cls_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        value = getattr(module, name)

        def new(typ: type, *args: Any, _v: int = value) -> Any:
            return NVMLError.__new__(typ, _v)

        cls = type(cls_name, (NVMLError,), {"__new__": new})
        cls.__module__ = __name__
        setattr(module, cls_name, cls)
        NVMLError._valClassMapping[value] = cls


_classes()

# ---------------------------------------------------------------------------- the state
_S: dict[str, Any] = {"node": None, "t0": None}


class _Handle:
    """An opaque device handle (``c_nvmlDevice_t`` in the bindings): a GPU, or one of its MIG instances."""

    def __init__(self, index: int, mig: int | None = None) -> None:
        self.index, self.mig = index, mig

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Handle) and (self.index, self.mig) == (other.index, other.mig)

    def __hash__(self) -> int:
        return hash((self.index, self.mig))


def _fail(code: int) -> None:
    raise NVMLError(code)


def nvmlInit() -> None:
    path = os.environ.get("GEMS_FAKE_NVML")
    if not path or not os.path.isfile(path):
        _fail(NVML_ERROR_LIBRARY_NOT_FOUND)
    with open(path) as f:
        state = json.load(f)
    here = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    node = state.get(here, state.get("*"))
    if node is None:
        _fail(NVML_ERROR_DRIVER_NOT_LOADED)
    _S["node"], _S["t0"] = node, float(state.get("t0", time.time()))


def nvmlInitWithFlags(flags: int) -> None:
    nvmlInit()


def nvmlShutdown() -> None:
    if _S["node"] is None:
        _fail(NVML_ERROR_UNINITIALIZED)
    _S["node"] = None


def _node() -> dict[str, Any]:
    if _S["node"] is None:
        _fail(NVML_ERROR_UNINITIALIZED)
    return _S["node"]


def _gpu(handle: _Handle, fn: str, mig_too: bool = False) -> dict[str, Any]:
    """The state of the handle's GPU, after the errors ``fn`` gives on it (unsupported on a MIG instance unless
    ``mig_too``; listed as unsupported or root's only)."""
    gpus = _node().get("gpus", [])
    if not isinstance(handle, _Handle) or not 0 <= handle.index < len(gpus):
        _fail(NVML_ERROR_INVALID_ARGUMENT)
    g = gpus[handle.index]
    if handle.mig is not None and not mig_too:
        _fail(NVML_ERROR_NOT_SUPPORTED)
    if fn in g.get("not_supported", []):
        _fail(NVML_ERROR_NOT_SUPPORTED)
    if fn in g.get("root_only", []) and not _node().get("root", os.geteuid() == 0):
        _fail(NVML_ERROR_NO_PERMISSION)
    time.sleep(float(g.get("slow", {}).get(fn, 0.0)))
    return g


def _mig(handle: _Handle) -> dict[str, Any] | None:
    return _node()["gpus"][handle.index]["mig"][handle.mig] if handle.mig is not None else None


# ---------------------------------------------------------------------------- system
def nvmlSystemGetDriverVersion() -> str:
    return str(_node().get("driver", "550.54.15"))


def nvmlSystemGetCudaDriverVersion() -> int:
    return int(_node().get("cuda", 12040))


def nvmlSystemGetCudaDriverVersion_v2() -> int:
    return nvmlSystemGetCudaDriverVersion()


def nvmlDeviceGetCount() -> int:
    return len(_node().get("gpus", []))


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    if not 0 <= int(index) < nvmlDeviceGetCount():
        _fail(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(int(index))


def nvmlDeviceGetHandleByUUID(uuid: str) -> _Handle:
    for i, g in enumerate(_node().get("gpus", [])):
        if _uuid(i, g) == uuid:
            return _Handle(i)
        for k, m in enumerate(g.get("mig", [])):
            if m["uuid"] == uuid:
                return _Handle(i, k)
    _fail(NVML_ERROR_NOT_FOUND)
    raise AssertionError  # unreachable


def _uuid(i: int, g: dict[str, Any]) -> str:
    return str(g.get("uuid", f"GPU-00000000-0000-0000-0000-{i:012d}"))


# ---------------------------------------------------------------------------- a device's identity
def nvmlDeviceGetUUID(handle: _Handle) -> str:
    g = _gpu(handle, "nvmlDeviceGetUUID", mig_too=True)
    m = _mig(handle)
    return str(m["uuid"]) if m is not None else _uuid(handle.index, g)


def nvmlDeviceGetName(handle: _Handle) -> str:
    g = _gpu(handle, "nvmlDeviceGetName", mig_too=True)
    return str(g.get("name", "NVIDIA H100 80GB HBM3")) + (" MIG" if handle.mig is not None else "")


def nvmlDeviceGetIndex(handle: _Handle) -> int:
    _gpu(handle, "nvmlDeviceGetIndex")
    return handle.index


# ---------------------------------------------------------------------------- MIG
def nvmlDeviceGetMigMode(handle: _Handle) -> list[int]:
    g = _gpu(handle, "nvmlDeviceGetMigMode")
    mode = NVML_DEVICE_MIG_ENABLE if g.get("mig") else NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(handle: _Handle) -> int:
    g = _gpu(handle, "nvmlDeviceGetMaxMigDeviceCount")
    return 7 if g.get("mig") else 0


def nvmlDeviceGetMigDeviceHandleByIndex(handle: _Handle, index: int) -> _Handle:
    g = _gpu(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
    if not 0 <= int(index) < len(g.get("mig", [])):
        _fail(NVML_ERROR_NOT_FOUND)
    return _Handle(handle.index, int(index))


def nvmlDeviceIsMigDeviceHandle(handle: _Handle) -> ctypes.c_uint:
    _gpu(handle, "nvmlDeviceIsMigDeviceHandle", mig_too=True)
    return ctypes.c_uint(1 if handle.mig is not None else 0)  # the bindings return the ctypes value itself


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: _Handle) -> _Handle:
    _gpu(handle, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", mig_too=True)
    if handle.mig is None:
        _fail(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(handle.index)


# ---------------------------------------------------------------------------- readings
def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetPowerUsage").get("power_mw", 70000))


def nvmlDeviceGetEnforcedPowerLimit(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetEnforcedPowerLimit").get("power_limit_mw", 700000))


def nvmlDeviceGetTotalEnergyConsumption(handle: _Handle) -> int:
    """mJ since the driver loaded: ``energy_mj`` at ``t0``, then the GPU's power draw over wall-clock time."""
    g = _gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")
    return int(g.get("energy_mj", 1_000_000) + g.get("power_mw", 70000) * (time.time() - _S["t0"]))


def nvmlDeviceGetClockInfo(handle: _Handle, type: int) -> int:
    g = _gpu(handle, "nvmlDeviceGetClockInfo")
    if type == NVML_CLOCK_SM or type == NVML_CLOCK_GRAPHICS:
        return int(g.get("sm_mhz", 1980))
    if type == NVML_CLOCK_MEM:
        return int(g.get("mem_mhz", 2619))
    _fail(NVML_ERROR_INVALID_ARGUMENT)
    raise AssertionError


def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").get("reasons", nvmlClocksEventReasonGpuIdle))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").get("reasons", nvmlClocksEventReasonGpuIdle))


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    g = _gpu(handle, "nvmlDeviceGetTemperature")
    if sensor != NVML_TEMPERATURE_GPU:
        _fail(NVML_ERROR_INVALID_ARGUMENT)
    return int(g.get("temp_c", 35))


def nvmlDeviceGetUtilizationRates(handle: _Handle) -> SimpleNamespace:
    g = _gpu(handle, "nvmlDeviceGetUtilizationRates")
    return SimpleNamespace(gpu=int(g.get("util", 0)), memory=int(g.get("mem_util", 0)))


def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> SimpleNamespace:
    g = _gpu(handle, "nvmlDeviceGetMemoryInfo", mig_too=True)
    m = _mig(handle)
    total = int((m or g).get("memory_total", 80 * 2**30))
    used = int((m or g).get("memory_used", 2**29))
    return SimpleNamespace(total=total, free=total - used, used=used)


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[SimpleNamespace]:
    g = _gpu(handle, "nvmlDeviceGetComputeRunningProcesses", mig_too=True)
    procs = (_mig(handle) or g).get("processes", [])
    return [SimpleNamespace(pid=os.getpid() if pid == "self" else int(pid), usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                            computeInstanceId=0xFFFFFFFF) for pid, used in procs]


# ---------------------------------------------------------------------------- health
def nvmlDeviceGetTotalEccErrors(handle: _Handle, errorType: int, counterType: int) -> int:
    g = _gpu(handle, "nvmlDeviceGetTotalEccErrors")
    if errorType != NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
        return int(g.get("ecc_corrected", 0))
    return int(g.get("ecc_uncorrected", 0)) if counterType == NVML_VOLATILE_ECC else int(g.get("ecc_aggregate", 0))


def nvmlDeviceGetRetiredPagesPendingStatus(device: _Handle) -> int:
    g = _gpu(device, "nvmlDeviceGetRetiredPagesPendingStatus")
    return NVML_FEATURE_ENABLED if g.get("retired_pending") else NVML_FEATURE_DISABLED


def nvmlDeviceGetRetiredPages(device: _Handle, sourceFilter: int) -> list[int]:
    return [int(a) for a in _gpu(device, "nvmlDeviceGetRetiredPages").get("retired", [])]


def nvmlDeviceGetRemappedRows(device: _Handle) -> tuple[int, int, int, int]:
    corr, unc, pending, failure = _gpu(device, "nvmlDeviceGetRemappedRows").get("remap", [0, 0, 0, 0])
    return int(corr), int(unc), int(pending), int(failure)


def _pcie(handle: _Handle, fn: str, k: int) -> int:
    return int(_gpu(handle, fn).get("pcie", [5, 5, 16, 16])[k])


def nvmlDeviceGetCurrPcieLinkGeneration(handle: _Handle) -> int:
    return _pcie(handle, "nvmlDeviceGetCurrPcieLinkGeneration", 0)


def nvmlDeviceGetMaxPcieLinkGeneration(handle: _Handle) -> int:
    return _pcie(handle, "nvmlDeviceGetMaxPcieLinkGeneration", 1)


def nvmlDeviceGetCurrPcieLinkWidth(handle: _Handle) -> int:
    return _pcie(handle, "nvmlDeviceGetCurrPcieLinkWidth", 2)


def nvmlDeviceGetMaxPcieLinkWidth(handle: _Handle) -> int:
    return _pcie(handle, "nvmlDeviceGetMaxPcieLinkWidth", 3)
