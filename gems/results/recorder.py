"""A training run's history as its steps go (losses, times and their terms), gathered from every rank at the end
into the run's record."""
from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Callable

from gems.results import record as rec

#: the terms of a step's time, as the record breaks it down
BREAKDOWN = rec.BREAKDOWN_KEYS


def new_history() -> dict[str, Any]:
    """A run's history before its first step (a checkpoint saves it, a resumed run goes on from it)."""
    return {"losses": [], "step_times": [], "nonfinite_steps": [], "every_step_time": [], "tensor_peaks": [],
            "breakdown": {k: 0.0 for k in BREAKDOWN}, "lrs": [], "validation": [], "elapsed_s": 0.0,
            "reader_s": 0.0}


class Recorder:
    """The run's history (a dict, saved with its checkpoints) and what makes the record of it: each step's time and
    terms (:meth:`account`), the time trained (:meth:`elapsed`), every rank's figures gathered (:meth:`gather`) and
    the record (:meth:`record`)."""

    def __init__(self, history: dict[str, Any]) -> None:
        self.history = history
        self.t_begin = time.time()
        # a pipeline's message times over the measured steps (a resumed run's: the steps after its restart only)
        self.sent: dict[tuple[int, ...], float] = {}
        self.received: dict[tuple[int, ...], tuple[float, float]] = {}

    def begin(self) -> None:
        """Training starts now (time to target counts from the first step, as MLPerf's run start)."""
        self.t_begin = time.time()

    def elapsed(self) -> float:
        """Seconds of training since the first step, evaluations included, across restarts."""
        return float(self.history["elapsed_s"]) + time.time() - self.t_begin

    def settle(self, reader_s: float) -> None:
        """Before the history is saved: the training time and the reader's ``reader_s`` so far move into it, so
        that a resumed run counts them as if it had not stopped."""
        h = self.history
        h["elapsed_s"], self.t_begin = self.elapsed(), time.time()
        h["reader_s"] += reader_s

    def account(self, dt: float, t_data: float, measured: bool, terms: dict[str, float], transfers: Any) -> None:
        """A step's time and terms (only measured steps count; every step's time is kept); ``transfers``: the
        pipeline's message times (gems.pipeline.runtime.Transfers), emptied here."""
        h = self.history
        if transfers is not None:
            if measured:
                self.sent.update(transfers.sent)
                self.received.update(transfers.received)
            transfers.sent.clear()
            transfers.received.clear()
        h["every_step_time"].append(dt)
        if not measured:
            return
        h["step_times"].append(dt)
        bd = h["breakdown"]
        bd["data"] += t_data
        for k, v in terms.items():
            bd[k] += v

    def gather(self, world: Any, meter: Any, tensor_peak: int | None, measured: int,
               split: Callable[[dict[Any, Any], dict[Any, Any]], tuple[float, Any]] | None = None
               ) -> tuple[list[int], list[str], list[Any], list[str], list[float], list[tuple[int | None, int | None]]]:
        """Every rank's peak memory, host and tensor peak, the step times as the slowest rank took them, this rank's
        pipeline waits split against every rank's send times (``split``: gems.pipeline.runtime.split_waits), and
        every rank's peak of requested bytes and of reserved ones (GPU ranks; None on CPU). A collective."""
        import torch
        import torch.distributed as dist

        bd = self.history["breakdown"]
        peak, requested = meter.peak(), (meter.requested_peak(), meter.reserved_peak())
        times = torch.tensor(self.history["step_times"], dtype=torch.float64, device=world.device)  # NCCL: on device
        if world.size == 1:
            return [peak], [world.hostname], [tensor_peak], [socket.gethostname()], times.tolist(), [requested]
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
        gathered: list[Any] = [None] * world.size
        dist.all_gather_object(gathered, (world.hostname, peak, tensor_peak, socket.gethostname(), self.sent,
                                          requested))
        if self.received and split is not None:
            everyone: dict[tuple[int, ...], float] = {}
            for g in gathered:
                everyone.update(g[4])
            transfer, _ = split(self.received, everyone)
            bd["pipeline_comm"] += transfer / max(1, measured)
            bd["bubble_or_wait"] = max(0.0, bd["bubble_or_wait"] - transfer / max(1, measured))
        return ([int(g[1]) for g in gathered], [g[0] for g in gathered], [g[2] for g in gathered],
                [g[3] for g in gathered], times.tolist(), [g[5] for g in gathered])

    def record(self, cfg: Any, world: Any, mesh: Any, meter: Any, *, global_batch: int, balance: list[int] | None,
               wall_s: float, restarts: int, measured_from: int, profiled_steps: int, notes: list[str],
               split: Callable[..., Any] | None = None) -> dict[str, Any]:
        """The run's record (complete on rank 0): step times and terms, memory and hosts of every rank.
        ``notes``: what the run says of how it ran; ``profiled_steps``: the steps profiled for tensor memory."""
        h = self.history
        step_times, breakdown = h["step_times"], h["breakdown"]
        measured = len(step_times)
        seen = h["tensor_peaks"]
        tensor_peak = max(seen) if seen else None
        for k in breakdown:
            breakdown[k] /= max(1, measured)
        peaks, hosts, tensor_peaks, machines, times, requested = self.gather(world, meter, tensor_peak, measured,
                                                                             split)
        # compute is what is left of this rank's median step after its measured terms; the record's step is the
        # slowest rank's (a step ends when its slowest rank ends), and the time this rank waits beyond its own
        # step for the slowest one is a wait: the terms sum to the recorded median
        here = statistics.median(step_times) if step_times else 0.0  # (a run that met its target at once)
        slowest = statistics.median(times) if times else 0.0
        breakdown["compute"] = max(0.0, here - sum(v for k, v in breakdown.items() if k != "compute"))
        breakdown["bubble_or_wait"] += max(0.0, slowest - sum(breakdown.values()))
        record = rec.build_record(
            cfg, world, mesh, losses=h["losses"], step_times=times, global_batch=global_batch, breakdown=breakdown,
            peaks=peaks, hosts=hosts, wall_s=wall_s, restarts=restarts,
            tensor_peaks=tensor_peaks if all(t is not None for t in tensor_peaks) else None, balance=balance,
            machines=machines,
        )
        asked = [r[0] for r in requested if r[0] is not None]
        if asked and len(asked) == len(requested):  # GPU ranks: what the tensors asked for, beside what CUDA counted
            record["peak_memory_bytes"].update(cuda_requested_max=max(asked), cuda_requested_per_rank=asked)
        held = [r[1] for r in requested if r[1] is not None]
        if held and len(held) == len(requested):  # and what the allocator held (a graph's pool too)
            record["peak_memory_bytes"].update(cuda_reserved_max=max(held), cuda_reserved_per_rank=held)
        record["step_time_s"]["every"] = h["every_step_time"]  # every step's time, warm-up and profiled ones too
        record["step_time_s"]["measured_from"] = measured_from
        if seen:
            record["peak_memory_bytes"]["tensor_steps"] = list(range(min(profiled_steps, len(seen))))
        if notes:
            record["notes"] = notes
        if h["nonfinite_steps"]:
            record["diverged"] = True
            record["nonfinite_steps"] = list(h["nonfinite_steps"])
        if "device_ops" in h:  # what the last untimed step launched outside a replay (gems.rank.graphs.DeviceOps)
            record["device_ops"] = h["device_ops"]
        return record

    def training_figures(self, train: Any, steps: int, steps_per_epoch: int) -> dict[str, Any]:
        """What the record keeps of training to a result: the learning rate of every step, the evaluations, the
        reader's own time, and the target (reached or not, and when)."""
        h = self.history
        ran = max(1, len(h["losses"]))
        out: dict[str, Any] = {"lr": list(h["lrs"]), "validation": list(h["validation"]),
                               "data_reader_s": float(h["reader_s"]) / ran, "steps_planned": steps,
                               "epochs": train.epochs, "steps_per_epoch": steps_per_epoch}
        if train.target_mae is not None:
            hit = h.get("target")
            out["target"] = {"metric": train.target_metric, "value": float(train.target_mae), "reached": bool(hit),
                             **(hit or {})}
            out["time_to_target_s"] = hit["time_to_target_s"] if hit else None
            out["epochs_to_target"] = hit["epoch"] if hit else None
        return out
