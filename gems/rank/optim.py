"""The optimizer of a rank's parameter copies (and of a rank that holds none), and the learning rate of each
step (:class:`LearningRate`: every rank sets the same rate at the same step, so the copies stay equal).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from omegaconf import DictConfig
from torch import nn


class _NoParameters:
    """The optimizer of a rank whose partitions hold no parameters (only pooling, say): nothing to step,
    a state that saves and loads like any other (torch's optimizers refuse an empty parameter list)."""

    def __init__(self) -> None:
        self.state: dict[Any, Any] = {}
        self.param_groups: list[dict[str, Any]] = []

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def make_optimizer(cfg: DictConfig, params: list[nn.Parameter], capturable: bool = False) -> torch.optim.Optimizer:
    """The run's optimizer over ``params``: torch's fused kernel (one launch a step on a GPU; on a CPU, SGD's
    arithmetic is the loop's, Adam's rounds differently in the last place). With ``train.graph_optimizer`` (the
    update inside a CUDA graph: gems.rank.graphs) its learning rate is a tensor on the parameters' device, which
    :class:`LearningRate` fills each step, and Adam keeps its step count there (``capturable``) on a GPU, in eager
    runs too, so that graphed and eager runs use the same kernels. ``capturable``: capturable without the tensor
    rate (gems bench step's plain loop captured whole)."""
    t = cfg.train
    if not params:  # a partition without parameters is legitimate (time balance may give a rank pooling only)
        return _NoParameters()  # type: ignore[return-value]
    device = params[0].device
    in_graph = bool(t.graph_optimizer)
    lr: Any = torch.tensor(float(t.lr), device=device) if in_graph else float(t.lr)
    if t.optimizer == "sgd":
        return _checked(torch.optim.SGD(params, lr=lr, momentum=float(t.momentum),
                                        weight_decay=float(t.weight_decay), fused=True))
    capture = (in_graph or capturable) and device.type == "cuda"  # (CPU Adam has no capturable kernel)
    return _checked(torch.optim.Adam(params, lr=lr, weight_decay=float(t.weight_decay), fused=True,
                                     capturable=capture))


def _checked(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt``, checked before every step as a GPU's fused kernel checks its tensors where a CPU rank computes in a
    GPU's layout (gems.rank.graphs.check_fused: the CPU kernels take what CUDA's refuse)."""
    from gems.rank.graphs import check_fused, gpu_layout

    device = opt.param_groups[0]["params"][0].device
    if gpu_layout(device):
        opt.register_step_pre_hook(lambda o, args, kwargs: check_fused(o))
    return opt


class LearningRate:
    """The learning rate of each step: ``train.lr`` (times ``train.batch_size / train.lr_base_batch`` with
    ``train.lr_scaling=linear``, times its square root with ``sqrt``), rising linearly from 0 over
    ``train.lr_warmup`` (epochs with ``train.epochs``, else steps), then ``constant``, ``step``
    (``train.lr_decay_factors[i]`` times it from ``train.lr_decay_boundaries[i]`` on) or ``cosine`` (down to 0
    at the run's last step). MLPerf HPC's
    CosmoFlow recipe: SGD, momentum 0.9, 0.001 at batch 64 scaled linearly, 4 warm-up epochs, 0.25 from epoch 32
    and 0.125 from epoch 64 (``model=cosmoflow_mlperf`` ships it)."""

    def __init__(self, t: Any, steps_per_unit: int, total_steps: int) -> None:
        ratio = int(t.batch_size) / int(t.lr_base_batch)
        self.base = float(t.lr) * {"linear": ratio, "sqrt": ratio ** 0.5}.get(str(t.lr_scaling), 1.0)
        self.schedule, self.total = str(t.lr_schedule), int(total_steps)
        self.warmup = float(t.lr_warmup) * steps_per_unit
        self.boundaries = [float(b) * steps_per_unit for b in (t.lr_decay_boundaries or [])]
        self.factors = [float(f) for f in (t.lr_decay_factors or [])]

    def at(self, step: int) -> float:
        if step < self.warmup:
            return self.base * (step + 1) / self.warmup
        if self.schedule == "step":
            factor = 1.0
            for b, f in zip(self.boundaries, self.factors):
                if step >= b:
                    factor = f
            return self.base * factor
        if self.schedule == "cosine":
            span = max(1.0, self.total - self.warmup)
            return self.base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - self.warmup) / span)))
        return self.base

    def apply(self, optimizer: Any, step: int) -> float:
        """Set the rate of ``step`` on every parameter group; returns it."""
        lr = self.at(step)
        for g in optimizer.param_groups:
            if isinstance(g["lr"], torch.Tensor):  # train.graph_optimizer: the graph reads it from the device
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        return lr




class WeightAverage:
    """``train.ema``: an exponential moving average of this rank's parameters after every optimizer step, which
    the evaluations use instead of the last step's (Polyak averaging: with small batches the weights wander
    about the minimum from step to step, and their average sits nearer it). The decay of step ``n`` is
    ``min(train.ema, (1 + n) / (10 + n))``, so the first steps do not weigh the initial weights for long. The
    average is kept in ``store["weight_average"]`` (the run's history, which every checkpoint saves, as it saves
    the fp16 loss scale; not the optimizer's state, where Adam takes any entry for its own), so a resumed run goes
    on from it. Each rank averages the parameters it holds, every copy the same values, so every mesh averages
    like one process."""

    def __init__(self, decay: float, params: list[nn.Parameter], store: dict[str, Any]) -> None:
        self.decay, self.params = float(decay), list(params)
        saved = store.get("weight_average") or []
        # a checkpoint is read onto the CPU: the average goes back to its parameter's device
        self.average: list[torch.Tensor] = [a.to(p.device) for a, p in zip(saved, self.params)]
        store["weight_average"] = self.average

    def update(self, step: int) -> None:
        """After step ``step``'s optimizer step."""
        with torch.no_grad():
            if not self.average:
                self.average.extend(p.detach().clone() for p in self.params)
                return
            d = min(self.decay, (1.0 + step) / (10.0 + step))
            torch._foreach_lerp_(self.average, [p.detach() for p in self.params], 1.0 - d)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The averaged weights in the parameters inside (none yet: the parameters as they are), the training's
        back after."""
        if not self.average:
            yield
            return
        saved = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                torch._foreach_copy_([p.detach() for p in self.params], self.average)
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.detach() for p in self.params], saved)
