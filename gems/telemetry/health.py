"""A node's GPUs checked before work lands on them: ``gems nodes check``, and once a node before a job's rendezvous.

Each check (gpus, ecc, retired_pages, row_remap, memory, throttle, pcie, driver) has a key of the ``health`` section
that skips it; a query NVML does not answer leaves its check out with the reason. A failed check stops the job before
training (:class:`BadNode`, exit 2) and leaves ``nodes/<node>.json`` where the launchers read it (:func:`failure_of`;
docs/faults.md, "Bad nodes").
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from gems.errors import ConfigError
from gems.telemetry import node_name, nvml

#: the checks, in the order they run; each is a key of the ``health`` section (false skips it)
CHECKS = ("gpus", "ecc", "retired_pages", "row_remap", "memory", "throttle", "pcie", "driver")
#: the throttle reasons that must not hold a GPU's clocks down at idle
IDLE_BAD = ("HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown")


@dataclass
class Finding:
    """One check of one GPU (``gpu`` None: of the node): passed (``ok``), failed, or left out (``ok`` None)."""

    check: str
    ok: bool | None
    value: str  # what was found, or why it was left out
    expected: str = ""
    gpu: int | None = None
    uuid: str = ""

    def where(self, node: str) -> str:
        return f"node {node}" + (f" GPU {self.gpu} ({self.uuid})" if self.gpu is not None else "")

    def line(self, node: str) -> str:
        """The one line of a failed check: node, GPU, check, value, what passes and the key that skips it."""
        return (f"{self.where(node)}: the {self.check} check failed: {self.value} (expected {self.expected}; "
                f"health.{self.check}=false skips it)")


class BadNode(ConfigError):
    """A node whose GPU failed a check: exit 2, its first failed check's one line."""

    def __init__(self, node: str, bad: list[Finding]) -> None:
        first = bad[0]
        super().__init__(f"health.{first.check}", first.value, first.expected)
        more = f" (and {len(bad) - 1} more failed check(s): {', '.join(f.check for f in bad[1:])})" if bad[1:] else ""
        self.args = (first.line(node) + more,)
        self.node, self.bad = node, bad


# ----------------------------------------------------------------------------- the checks
def _lib() -> Any:
    return nvml.library()


def _gpus(seen: list[nvml.Gpu], want: int) -> Finding:
    if want > len(seen):
        return Finding("gpus", False, f"{len(seen)} GPU(s) seen ({_visible_text()}), {want} asked for",
                       f"{want} or more (cluster.gpus_per_node, or the node's GPU ranks)")
    return Finding("gpus", True, f"{len(seen)} GPU(s) seen, {want} asked for")


def _visible_text() -> str:
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "every GPU NVML counts" if spec is None else f"CUDA_VISIBLE_DEVICES={spec!r}"


def _ecc(g: nvml.Gpu) -> Finding:
    lib = _lib()
    got = nvml.ask(g, "nvmlDeviceGetTotalEccErrors", lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC)
    if got.why is not None:
        return Finding("ecc", None, got.why)
    n = int(got.value)
    return Finding("ecc", n == 0, f"{n} uncorrected ECC error(s) since the driver loaded", "none")


def _retired_pages(g: nvml.Gpu) -> Finding:
    got = nvml.ask(g, "nvmlDeviceGetRetiredPagesPendingStatus")
    if got.why is not None:
        return Finding("retired_pages", None, got.why)
    pending = int(got.value) == int(_lib().NVML_FEATURE_ENABLED)
    return Finding("retired_pages", not pending, "pages wait to be retired (at the GPU's next reset)" if pending
                   else "no page waits to be retired", "none waiting")


def _row_remap(g: nvml.Gpu) -> Finding:
    got = nvml.ask(g, "nvmlDeviceGetRemappedRows")
    if got.why is not None:
        return Finding("row_remap", None, got.why)
    _corr, _unc, pending, failure = (int(v) for v in got.value)
    if failure:
        return Finding("row_remap", False, "a row remap failed", "no failed remap")
    if pending:
        return Finding("row_remap", False, "row remaps wait for the GPU's reset", "none waiting")
    return Finding("row_remap", True, "no remap failed or waiting")


def _memory(g: nvml.Gpu, ours: Callable[[int], bool]) -> Finding:
    got = nvml.ask(g, "nvmlDeviceGetComputeRunningProcesses")
    if got.why is not None:
        return Finding("memory", None, got.why)
    others = [p for p in got.value if not ours(int(p.pid))]
    if not others:
        return Finding("memory", True, "no process of another job")
    held = sum(int(p.usedGpuMemory or 0) for p in others)
    pids = ", ".join(str(p.pid) for p in others[:4]) + (" ..." if len(others) > 4 else "")
    return Finding("memory", False, f"{held / 2**30:.2f} GiB held by {len(others)} process(es) not of this job "
                   f"(pid {pids})", "no memory held by another job")


def _throttle(g: nvml.Gpu, mask: nvml.Got) -> Finding:
    if mask.why is not None:
        return Finding("throttle", None, mask.why)
    lib = _lib()
    bad = 0
    for suffix in IDLE_BAD:
        bad |= int(getattr(lib, f"nvmlClocksEventReason{suffix}", getattr(lib, f"nvmlClocksThrottleReason{suffix}", 0)))
    held = nvml.reasons(mask.value & bad)
    if held:
        return Finding("throttle", False, "clocks held down at idle: " + ", ".join(held),
                       "no hardware slowdown, thermal slowdown or power brake")
    return Finding("throttle", True, "active: " + (", ".join(nvml.reasons(mask.value)) or "none"))


def _pcie(g: nvml.Gpu, mask: nvml.Got) -> Finding:
    got = {k: nvml.ask(g, f"nvmlDevice{k}") for k in ("GetCurrPcieLinkGeneration", "GetMaxPcieLinkGeneration",
                                                        "GetCurrPcieLinkWidth", "GetMaxPcieLinkWidth")}
    why = next((v.why for v in got.values() if v.why is not None), None)
    if why is not None:
        return Finding("pcie", None, why)
    gen, top_gen, width, top_width = (int(v.value) for v in got.values())
    link = f"PCIe gen {gen} x{width} (at most gen {top_gen} x{top_width})"
    if width < top_width:
        return Finding("pcie", False, link, f"x{top_width}")
    idle = mask.why is None and "idle" in nvml.reasons(mask.value)
    if gen < top_gen and not idle:
        return Finding("pcie", False, link, f"gen {top_gen}")
    if gen < top_gen:
        return Finding("pcie", None, f"{link}: the generation is not judged at idle (the link slows down then)")
    return Finding("pcie", True, link)


def _cuda(v: int) -> tuple[int, int]:
    return v // 1000, (v % 1000) // 10


def _driver() -> Finding:
    import torch

    built = torch.version.cuda
    got = nvml.ask(None, "nvmlSystemGetCudaDriverVersion")
    if got.why is not None:
        return Finding("driver", None, got.why)
    if not built:
        return Finding("driver", None, "torch was built without CUDA")
    drv = nvml.ask(None, "nvmlSystemGetDriverVersion")
    runs = "{}.{}".format(*_cuda(int(got.value)))
    name = f"driver {drv.value} runs CUDA up to {runs}" if drv.why is None else f"the driver runs CUDA up to {runs}"
    want = tuple(int(x) for x in str(built).split(".")[:2])
    if _cuda(int(got.value))[0] < want[0]:
        return Finding("driver", False, f"{name}; torch was built for CUDA {built}", f"a driver for CUDA {built}")
    return Finding("driver", True, f"{name}; torch was built for CUDA {built}")


def _physical(seen: list[nvml.Gpu]) -> list[nvml.Gpu]:
    """The GPUs behind ``seen`` (a MIG instance's GPU), once each."""
    out: dict[str, nvml.Gpu] = {}
    for g in seen:
        p = g.parent or g
        out.setdefault(p.uuid, p)
    return list(out.values())


def check(health: Any, want: int, ours: Callable[[int], bool] | None = None) -> list[Finding]:
    """Every check ``health`` does not skip, on the GPUs this process sees; ``want``: the GPUs the job asked for
    on this node (0: not counted); ``ours(pid)``: whether a process is this job's (default :func:`of_this_job`)."""
    seen = nvml.visible()
    on = {c for c in CHECKS if bool(getattr(health, c))}
    found = [_gpus(seen, want)] if "gpus" in on else []
    for g in _physical(seen):
        mask = nvml.throttle_mask(g)
        each = {"ecc": lambda: _ecc(g), "retired_pages": lambda: _retired_pages(g),
                "row_remap": lambda: _row_remap(g), "memory": lambda: _memory(g, ours or of_this_job),
                "throttle": lambda: _throttle(g, mask), "pcie": lambda: _pcie(g, mask)}
        for name, run in each.items():
            if name in on:
                f = run()
                f.gpu, f.uuid = g.index, g.uuid
                found.append(f)
    if "driver" in on and seen:
        found.append(_driver())
    return found


# ----------------------------------------------------------------------------- this job's processes
def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past the command's parentheses


def of_this_job(pid: int) -> bool:
    """Whether process ``pid`` is this job's: this process, a task of the same Slurm job (its ``SLURM_JOB_ID``), or
    a process the same local launcher started (``GEMS_LAUNCHER_PID`` among its ancestors). A process this node's
    namespace does not show (a container's NVML reports the host's ids) is not."""
    if pid == os.getpid():
        return True
    job = os.environ.get("SLURM_JOB_ID")
    if job and _environ(pid).get("SLURM_JOB_ID") == job:
        return True
    launcher = os.environ.get("GEMS_LAUNCHER_PID", "")
    at: int | None = pid
    for _ in range(64):  # the chain up to init
        if at is None or at <= 1:
            return False
        if launcher.isdigit() and at == int(launcher):
            return True
        at = _parent(at)
    return False


# ----------------------------------------------------------------------------- before the rendezvous
def local_rank() -> int:
    """This task's rank on its node, from the launcher's environment (the local launcher's and torchrun's, Slurm's,
    MPICH's or Open MPI's); 0 where none says."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def wanted(cfg: Any, device: str) -> bool:
    """Whether ``health.check`` runs the check for a job whose ranks run on ``device``: ``always``, ``never``, or
    ``auto`` where they use GPUs (a CPU job never imports pynvml unless asked)."""
    mode = str(cfg.health.check)
    return mode == "always" or (mode == "auto" and device == "cuda")


def check_node(cfg: Any, device: str, ranks: int, job_dir: Path | str) -> None:
    """The node's check, before the rendezvous, by the node's first task (the others go on): every rank calls it.
    ``device``: what the job's ranks run on (``gems.bootstrap.job_device``), ``ranks``: the job's ranks on this node.
    A failed check writes ``nodes/<node>.json`` in ``job_dir`` and raises :class:`BadNode`."""
    if not wanted(cfg, device) or local_rank() != 0:
        return
    if nvml.library() is None:
        nvml.note_absent("the node's health check is left out")
        return
    want = int(cfg.cluster.gpus_per_node or 0) or (ranks if device == "cuda" else 0)
    node = node_name()
    bad = [f for f in check(cfg.health, want) if f.ok is False]
    if bad:
        write_failure(Path(job_dir), node, bad)
        raise BadNode(node, bad)


def write_failure(job_dir: Path, node: str, bad: list[Finding]) -> Path:
    """Write the node's failed checks where the launchers read them (``nodes/<node>.json`` in the run's folder)."""
    d = job_dir / "nodes"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{node}.json"
    tmp = d / f".{node}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"node": node, "time": time.time(), "error": bad[0].line(node),
                               "findings": [asdict(f) for f in bad]}))
    os.replace(tmp, path)
    return path


def bad_nodes(job_dir: Path | str) -> list[dict[str, Any]]:
    """The nodes of a run whose check failed (what :func:`keep` wrote), first found first."""
    d = Path(job_dir) / "nodes"
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda b: float(b.get("time", 0.0)))


def failure_of(job_dir: Path | str) -> tuple[str, dict[str, Any]] | None:
    """(the error line, the record's ``failure``) of a run a node's check stopped; None where none did."""
    bad = bad_nodes(job_dir)
    if not bad:
        return None
    first = bad[0]["findings"][0]
    return bad[0]["error"], {"kind": "bad_node", "node": bad[0]["node"], "gpu": first.get("gpu"),
                             "uuid": first.get("uuid"), "check": first["check"], "value": first["value"],
                             "nodes": [b["node"] for b in bad]}


# ----------------------------------------------------------------------------- gems nodes check
def describe(node: str, found: list[Finding]) -> list[str]:
    """One line a GPU (and one for the node's own checks): each check's result, failed ones first."""
    by: dict[tuple[int | None, str], list[Finding]] = {}
    for f in found:
        by.setdefault((f.gpu, f.uuid), []).append(f)
    lines = []
    for (gpu, uuid), fs in by.items():
        head = f"{node}" + (f" GPU {gpu} ({uuid})" if gpu is not None else "")
        bad = [f"FAILED {f.check}: {f.value}" for f in fs if f.ok is False]
        good = [f.check for f in fs if f.ok]
        out = [f"left out {f.check}: {f.value}" for f in fs if f.ok is None]
        lines.append(f"{head}: " + "; ".join(bad + ([f"ok {', '.join(good)}"] if good else []) + out))
    return lines


def node_report(health: Any, want: int) -> dict[str, Any]:
    """This node's findings as JSON: what a task of ``gems nodes check`` reports."""
    node = node_name()
    if nvml.library() is None:  # no GPU to check: a failure only where the job asks for GPUs
        why = f"no NVML here ({nvml.absent()})"
        found = [Finding("gpus", False, f"{why}: no GPU seen", f"{want} GPU(s)") if want else Finding("gpus", None, why)]
    else:
        found = check(health, want)
    return {"node": node, "findings": [asdict(f) for f in found]}


def task(cfg_yaml: str) -> int:
    """One Slurm task of ``gems nodes check`` (one a node): its node's findings written to ``check.out``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(cfg_yaml)
    report = node_report(cfg.health, int(cfg.cluster.gpus_per_node or 0))
    out = Path(str(cfg.check_out))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{report['node']}.json").write_text(json.dumps(report))
    return len(report["findings"])


def nodes_main(cfg: Any, job: Callable[..., int] | None = None) -> int:
    """``gems nodes check``: the checks here (``cluster=local``), or on every node of a Slurm job (one task a node,
    through ``job``: :func:`gems.launch.tasks.run_tasks`); each GPU's results, then one line. 0 where every check
    passed or was left out, 2 where one failed."""
    from omegaconf import open_dict

    want = int(cfg.cluster.gpus_per_node or 0)
    if cfg.cluster.launcher != "slurm":
        reports = [node_report(cfg.health, want)]
    elif job is None:
        raise ConfigError("cluster", cfg.cluster.name, "cluster=local here (a Slurm job is submitted by the "
                          "`gems nodes check` command)")
    else:
        with open_dict(cfg):
            cfg.run_id = f"nodes-check-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            cfg.cluster.tasks_per_node = 1
            cfg.check_out = str(Path(str(cfg.results.dir)).resolve() / ".jobs" / cfg.run_id / "found")
        job(cfg, task, "check", f"the GPUs of {int(cfg.cluster.nodes or 1)} node(s)", prefix="gems nodes")
        reports = [json.loads(p.read_text()) for p in sorted(Path(str(cfg.check_out)).glob("*.json"))]
    return _said(reports)


def _said(reports: list[dict[str, Any]]) -> int:
    bad: list[str] = []
    gpus = 0
    for r in reports:
        found = [Finding(**f) for f in r["findings"]]
        gpus += len({f.uuid for f in found if f.gpu is not None})
        for line in describe(r["node"], found):
            print(line, flush=True)
        bad += [f.line(r["node"]) for f in found if f.ok is False]
    head = f"gems nodes check: {len(reports)} node(s), {gpus} GPU(s)"
    print(f"{head}: {len(bad)} failed check(s): " + "; ".join(bad) if bad else f"{head}: no check failed", flush=True)
    return 2 if bad else 0


__all__ = ["BadNode", "CHECKS", "Finding", "bad_nodes", "check", "check_node", "describe", "failure_of",
           "local_rank", "node_report", "nodes_main", "of_this_job", "task", "wanted", "write_failure"]
