"""The weighted local loss of a rank: summed over every rank it is the serial mean loss (docs/design.md).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from gems.data.layouts import IGNORE
from gems.mesh import Mesh
from gems.models import ModelSpec


def ignored(spec: ModelSpec) -> int:
    """The label a model of dense classes leaves out of its loss and figures: :data:`gems.data.layouts.IGNORE`
    (255: read volumes' padding) where it is not one of its classes, else none (-100, torch's default)."""
    return IGNORE if int(spec.num_outputs) <= IGNORE else -100


# ---------------------------------------------------------------------------- loss
def make_loss_fn(spec: ModelSpec, mesh: Mesh, global_batch: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The weighted local loss: summed over all ranks it equals the serial mean loss (docs/design.md)."""
    gathered = mesh.spatial_enabled and spec.spatial_end is not None
    part_weight = 1.0 / mesh.spatial if gathered else 1.0

    if spec.target == "dense":
        cells = math.prod(spec.input_shape[1:])
        ignore = ignored(spec)

        def dense(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # classes may come as uint8 (read labels: an eighth of the bytes); a label of ``ignore`` (a tile's
            # padding) adds nothing, and the divisor stays every cell of the batch: a sum over the parts on any mesh
            if spec.loss == "cross_entropy":
                s = F.cross_entropy(out.float(), y.long(), reduction="sum", ignore_index=ignore)
            else:
                s = F.mse_loss(out.float(), y.float(), reduction="sum") / out.shape[1]
            return s / (cells * global_batch)

        return dense

    def vector(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if spec.loss == "cross_entropy":
            s = F.cross_entropy(out.float(), y, reduction="sum")
        else:
            s = F.mse_loss(out.float(), y.float(), reduction="sum") / out.shape[1]
        return s * (part_weight / global_batch)

    return vector




# ---------------------------------------------------------------------------- evaluation metrics
class Metric:
    """What an evaluation sums on each rank and reports once summed over the world (:meth:`report`).

    A rank's sums cover the outputs it computed: a whole sample's vector output once per sample (with the
    spatial parts gathered before the head, only part 0 counts it: every part computes the same head), a dense
    output's cells on the part that holds them. Summed over every rank they are the serial sums, so the figures
    equal one process evaluating the same model on the same set, to float rounding.

    The vector is ``[loss sum, count, (vector mse) |error| sum per target ... | (classification) correct]``:
    the loss is the training loss's per-sample (per-cell for dense outputs) mean; ``mae`` the mean absolute
    error over samples and targets, ``mae_per_target`` per target; ``accuracy`` the share of correct classes.
    A classifier of each voxel (dense cross-entropy: the U-Net) counts only the voxels whose label is not
    ignored (:func:`ignored`: a read volume's padding, and the samples that fill a last partial batch): ``cells``,
    the loss's and accuracy's divisor, are those. It also sums, per class, the voxels predicted and
    labelled that class and both (the confusion matrix's margins and diagonal): ``dice`` per class is
    ``2 |P & L| / (|P| + |L|)`` over the whole set (the voxels of every sample together: sums that add up over
    parts and replicas; None for a class neither predicted nor labelled), ``dice_foreground`` its mean over the
    classes after 0 (background).

    :meth:`group_by` (``train.eval_average_crops``) adds, per group of samples (the crops of one file), the sums
    of their predictions and targets and their count: ``mae_avg_crops`` is the error of the groups' mean
    predictions, the fair baseline for small crops of larger universes.
    """

    def __init__(self, spec: ModelSpec, mesh: Mesh, counts: bool) -> None:
        self.spec, self.counts = spec, counts  # counts: whether this rank's outputs count (see above)
        self.classes = spec.loss == "cross_entropy"
        self.dice = self.classes and spec.target == "dense"  # per class: predicted, labelled, both (docstring)
        self.base = 2 + (1 if self.classes else int(spec.num_outputs)) + (3 * int(spec.num_outputs) if self.dice else 0)
        self.group_of: Callable[[int], int] | None = None
        self.groups = 0
        #: gems eval: each counted sample's row, kept on the host (None in training: an evaluation reads nothing)
        self.keep: list[tuple[list[int], torch.Tensor, torch.Tensor]] | None = None

    @property
    def size(self) -> int:
        return self.base + self.groups * (2 * int(self.spec.num_outputs) + 1)

    def group_by(self, group_of: Callable[[int], int], groups: int) -> None:
        """Also sum the predictions per group: sample ``i`` (its index in the evaluated set) is in group
        ``group_of(i)`` of ``groups`` (vector targets only)."""
        if self.classes or self.spec.target != "vector":
            raise ValueError("crop averages are for vector targets")
        self.group_of, self.groups = group_of, int(groups)

    def __call__(self, out: torch.Tensor, y: torch.Tensor, ids: Sequence[int] = ()) -> torch.Tensor:
        out = out.float()
        if not self.counts:
            return torch.zeros(self.size, dtype=torch.float64, device=out.device)
        count: Any
        if self.classes and self.dice:  # a class a voxel: its ignored labels count nowhere (class docstring)
            y = y.long()  # read labels come as uint8
            ignore = ignored(self.spec)
            loss = F.cross_entropy(out, y, reduction="sum", ignore_index=ignore)
            predicted = out.argmax(dim=1)
            valid = y != ignore
            extra = [((predicted == y) & valid).sum()]
            count = valid.sum()
            # the confusion matrix (labelled x predicted) of the counted voxels: its diagonal and margins
            k = int(self.spec.num_outputs)
            conf = torch.bincount((y[valid] * k + predicted[valid]), minlength=k * k).reshape(k, k)
            extra += [*conf.diagonal(), *conf.sum(dim=0), *conf.sum(dim=1)]
        elif self.classes:
            y = y.long()
            loss = F.cross_entropy(out, y, reduction="sum")
            predicted = out.argmax(dim=1)
            extra = [(predicted == y).sum()]
            count = y.numel()
        else:
            err = out - y.float()
            loss = (err ** 2).mean(dim=1).sum() if self.spec.target != "dense" else (err ** 2).sum() / out.shape[1]
            extra = list(err.abs().sum(dim=0)) if self.spec.target != "dense" else [err.abs().sum()]
            count = y.shape[0] if self.spec.target != "dense" else y[:, 0].numel()
        if self.keep is not None:
            self.keep.append(self._rows(out, y, ids))
        vec = torch.stack([v.double() for v in [loss, torch.as_tensor(count, device=out.device), *extra]])
        if not self.groups:
            return vec
        if self.group_of is None or len(ids) != out.shape[0]:
            raise ValueError(f"crop averages need each sample's index ({len(ids)} for {out.shape[0]} outputs)")
        per = torch.zeros((self.groups, 2 * out.shape[1] + 1), dtype=torch.float64, device=out.device)
        rows = torch.cat([out.double(), y.double(), torch.ones((out.shape[0], 1), dtype=torch.float64,
                                                                 device=out.device)], dim=1)
        per.index_add_(0, torch.tensor([self.group_of(int(i)) for i in ids], device=out.device), rows)
        return torch.cat([vec, per.reshape(-1)])

    def _rows(self, out: torch.Tensor, y: torch.Tensor, ids: Sequence[int]) -> tuple[list[int], torch.Tensor,
                                                                                      torch.Tensor]:
        """(sample ids, what was predicted, the target) on the host: a vector's outputs; a class's scores'
        argmax; for dense outputs the sums over the cells this rank holds of each sample (|error|, squared error
        and cells), which add up over the parts."""
        n = out.shape[0]
        if self.spec.target == "dense":  # per sample: (loss sum, |error| sum or correct cells, cells) of this part
            if self.classes:  # the counted cells (a sample's part of padding alone counts none: left out)
                ignore = ignored(self.spec)
                valid = y != ignore
                cells = valid.flatten(1).sum(1).float()
                loss = F.cross_entropy(out, y, reduction="none", ignore_index=ignore).flatten(1).sum(1)
                second = ((out.argmax(dim=1) == y) & valid).flatten(1).sum(1).float()
            else:
                cells = torch.full((n,), float(y[0, 0].numel()), device=out.device)
                err = out - y.float()
                loss = (err ** 2).flatten(2).sum(dim=(1, 2)) / out.shape[1]
                second = err.abs().flatten(2).sum(dim=(1, 2)) / out.shape[1]
            rows = torch.stack([loss, second, cells], 1).double().cpu()
            kept = [k for k in range(n) if float(rows[k, 2]) > 0]
            return ([ids[k] for k in kept] if len(ids) == n else list(ids)), rows[kept], torch.zeros(0)
        if self.classes:
            return list(ids), out.detach().double().cpu(), y.cpu()
        return list(ids), out.detach().double().cpu(), y.double().cpu()

    def report(self, total: torch.Tensor | list[float]) -> dict[str, Any]:
        """The figures of a summed vector (a tensor, or its values already read to the host: one read of the
        device an evaluation): ``loss``, and ``mae`` with ``mae_per_target`` or ``accuracy``; with groups
        ``mae_avg_crops`` and ``mae_avg_crops_per_target`` too."""
        values = [float(x) for x in (total if isinstance(total, list) else total.tolist())]
        v = values[:self.base]
        loss, n = v[0], max(v[1], 1.0)
        if self.classes and self.dice:
            k = int(self.spec.num_outputs)
            both, predicted, labelled = v[3:3 + k], v[3 + k:3 + 2 * k], v[3 + 2 * k:3 + 3 * k]
            dice = [2 * b / (p + t) if p + t else None for b, p, t in zip(both, predicted, labelled)]
            fore = [d for d in dice[1:] if d is not None]
            return {"loss": loss / n, "accuracy": v[2] / n, "dice": dice,
                    "dice_foreground": sum(fore) / len(fore) if fore else None, "cells": int(n)}
        if self.classes:
            return {"loss": loss / n, "accuracy": v[2] / n, "samples": int(n)}
        per = [e / n for e in v[2:]]
        if self.spec.target == "dense":
            return {"loss": loss / n, "mae": per[0] / max(1, int(self.spec.num_outputs)), "cells": int(n)}
        out: dict[str, Any] = {"loss": loss / n, "mae": sum(per) / len(per), "mae_per_target": per, "samples": int(n)}
        if self.groups:
            t = int(self.spec.num_outputs)
            g = torch.tensor(values[self.base:], dtype=torch.float64).reshape(self.groups, 2 * t + 1)
            seen = g[:, -1] > 0
            err = (g[seen, :t] / g[seen, -1:] - g[seen, t:2 * t] / g[seen, -1:]).abs().mean(dim=0).tolist()
            out["mae_avg_crops_per_target"] = err
            out["mae_avg_crops"] = sum(err) / len(err) if err else float("nan")
            out["groups"] = int(seen.sum())
        return out


def described(figures: dict[str, Any], names: list[str] | None = None) -> str:
    """A validation's figures in one line: every float, then each class's Dice by name (``names``, by label)."""
    shown = [f"{k} {v:.4g}" for k, v in figures.items() if isinstance(v, float)]
    dice = figures.get("dice")
    if isinstance(dice, list):
        labels = names if names and len(names) == len(dice) else [f"class {k}" for k in range(len(dice))]
        shown.append("Dice " + ", ".join(f"{n} {'-' if d is None else format(d, '.4g')}" for n, d in zip(labels, dice)))
    return ", ".join(shown)
