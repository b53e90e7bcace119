"""Mixed precision on a rank: the autocast region, and fp16's loss scaling by ``torch.amp.GradScaler``'s dynamic rule,
one skip decision for the whole world (docs/gpu.md, "fp16").
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["autocast", "LossScaler", "scaling_enabled"]


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The autocast region of a forward: none for fp32, else ``torch.autocast`` to bf16 or fp16 (CPU ranks run
    fp16 too, slowly: for checks; GPUs are what it is for)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def scaling_enabled(precision: str, loss_scaling: str) -> bool:
    """``train.loss_scaling``: auto scales fp16 only; dynamic always; off never."""
    return loss_scaling == "dynamic" or (loss_scaling == "auto" and precision == "fp16")


class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``, the skip decided over every rank.

    ``scale(loss)`` before the backward; after the gradient sum, ``step(optimizer)`` unscales, agrees on
    overflow with every rank, steps or skips, and moves the scale. ``step_late`` does the same without reading the
    verdict on the host where a fused optimizer can skip on the device (the training loop's: the verdict is read
    with the step's figures, and :meth:`settle` records it). Disabled: ``scale`` is the identity and ``step`` only
    steps.
    """

    def __init__(self, device: torch.device, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
        self.enabled = enabled
        self.device = device
        self.growth_interval, self.growth, self.backoff = int(growth_interval), growth_factor, backoff_factor
        self.value = float(init_scale)
        self.clean = 0  # steps since the scale last moved
        self.skipped: list[int] = []
        self._scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_factor=growth_factor,
                                            backoff_factor=backoff_factor, growth_interval=growth_interval,
                                            enabled=enabled)
        if enabled:  # GradScaler makes its scale tensor on the first scale(); unscale_ needs it
            self._scaler.scale(torch.zeros((), device=device))

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: times the scale's device copy (GradScaler's, which :meth:`step` keeps
        equal to the host value, and :meth:`step_late` moves first: the host's follows when the step's figures are
        read, possibly after the next step began), the same product as by the host value (the scale is a float32
        value: a float32 loss times it is the same either way), and one a CUDA graph replays with the scale of the
        step, not of its capture."""
        if not self.enabled:
            return loss
        scale = self._scaler._scale  # (the one other private field read here; made in __init__)
        assert scale is not None
        return loss * scale

    scale_on_device = scale  # (the graphed step's name for it)

    def step(self, optimizer: Any, step: int, group: Any = None) -> bool:
        """Unscale this rank's (summed) gradients, agree on overflow over ``group`` (None: the world, when a
        process group exists), then step the optimizer unless some rank overflowed; True when it stepped. The
        verdict is read on the host (:meth:`step_late` leaves it on the device)."""
        if not self.enabled:
            optimizer.step()
            return True
        verdict = self._verdict(optimizer, group)
        return self._decide_on_host(optimizer, step, verdict)

    def step_late(self, optimizer: Any, step: int, group: Any = None) -> torch.Tensor | None:
        """:meth:`step` without reading the verdict on the host, where that is exact: the world's verdict (1.0 where
        some rank overflowed) goes to torch's fused kernel as its ``found_inf``, which then leaves the parameters
        and the optimizer's state untouched, and the scale moves on the device by GradScaler's rule; returns the
        verdict (a float64 vector of one, on the device), which the caller reads later and hands to :meth:`settle`
        (the skipped steps, the scale's host copy). None where the step was decided on the host as :meth:`step`
        does (and settled): a step that makes the optimizer's state (torch's fused SGD told to skip its first step
        leaves its momentum unwritten, which later steps read), an optimizer without fused kernels, disabled
        scaling."""
        if not self.enabled:
            optimizer.step()
            return None
        verdict = self._verdict(optimizer, group)
        holds = verdict.found is not None
        fresh = holds and any(not optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]
                              if p.grad is not None)
        if fresh or (holds and not getattr(optimizer, "_step_supports_amp_scaling", False)):
            self._decide_on_host(optimizer, step, verdict)
            return None
        flag = verdict.flag.reshape(())
        if verdict.found is not None:
            for v in verdict.found.values():
                v.copy_(flag.to(v.device))  # what GradScaler.step hands the fused kernel: the world's verdict
            self._scaler.step(optimizer)
            self._scaler.update()  # (the scale by the same verdict: GradScaler reads the flags just written)
        else:
            scale, tracker = self._scaler._scale, self._scaler._growth_tracker
            assert scale is not None and tracker is not None
            torch._amp_update_scale_(scale, tracker, flag.to(scale.device, torch.float32), self.growth,
                                     self.backoff, self.growth_interval)
        return verdict.flag.to(torch.float64).reshape(1)

    def settle(self, step: int, overflow: bool) -> None:
        """The host's record of step ``step``, decided on the device (:meth:`step_late`): the skipped steps, and
        the scale's host copy moved by the rule the device applied (the same float32 arithmetic)."""
        self._move(step, overflow)

    def _move(self, step: int, overflow: bool) -> None:
        """GradScaler's rule on the host copy (torch's ``_amp_update_scale_``, in float32): on overflow the scale
        backs off and the clean steps restart; after ``growth_interval`` clean steps it grows, where the grown
        scale is finite."""
        if overflow:
            self.value = float(np.float32(self.value) * np.float32(self.backoff))
            self.clean = 0
            self.skipped.append(int(step))
        else:
            self.clean += 1
            if self.clean == self.growth_interval:
                grown = np.float32(self.value) * np.float32(self.growth)
                if np.isfinite(grown):
                    self.value = float(grown)
                self.clean = 0

    def _verdict(self, optimizer: Any, group: Any) -> "_Verdict":
        """Unscale this rank's gradients and agree on overflow over ``group``: the world's flag, on the device."""
        import torch.distributed as dist

        holds = any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        found = None
        if holds:
            self._scaler.unscale_(optimizer)
            found = self._found(optimizer)
            flag = torch.stack([v.to(self.device) for v in found.values()]).amax().reshape(1)
        else:  # a partition without parameters still takes part in the decision
            flag = torch.zeros(1, device=self.device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return _Verdict(flag, found)

    def _decide_on_host(self, optimizer: Any, step: int, verdict: "_Verdict") -> bool:
        flag, found = verdict.flag, verdict.found
        overflow = bool(flag.item() > 0)
        if found is not None and not overflow:  # a skipped step calls no optimizer: a fused kernel told to skip a
            for v in found.values():  # first step leaves its momentum buffer unwritten (torch's fused SGD)
                v.copy_(flag.reshape(()).to(v.device))  # what GradScaler.step reads: the world's verdict
            self._scaler.step(optimizer)
        self._move(step, overflow)
        self._scaler.update(self.value)  # the same rule on every rank: the scales stay equal
        self._track()
        return not overflow

    def _track(self) -> None:
        """GradScaler's count of clean steps, the host's (a step decided on the device moves it there)."""
        tracker = self._scaler._growth_tracker
        if tracker is not None:
            tracker.fill_(self.clean)

    def _found(self, optimizer: Any) -> dict[Any, torch.Tensor]:
        """GradScaler's per-device overflow flags of ``optimizer`` after ``unscale_`` (the one private field
        read here; a test fails loudly if torch renames it)."""
        return self._scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.value, "clean": self.clean, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.clean, self.skipped = float(state["scale"]), int(state["clean"]), list(state["skipped"])
        if self.enabled:
            self._scaler.update(self.value)
            self._track()

    def summary(self) -> dict[str, Any]:
        """What the record keeps: the scale at the end and the steps skipped for Inf/NaN gradients."""
        return {"final_scale": self.value, "skipped_steps": list(self.skipped)}


@dataclass
class _Verdict:
    """The world's overflow flag of a step (1.0 where some rank overflowed; on the device) and this rank's
    GradScaler flags (None where it holds no gradient)."""

    flag: torch.Tensor
    found: dict[Any, torch.Tensor] | None
