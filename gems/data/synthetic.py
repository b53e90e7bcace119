"""Synthetic samples that are a pure function of (seed, sample index), so that every mesh sees the same global batch.

A sample is drawn in aligned blocks of planes along spatial dim 0, each from its own seeded generator, their size set
by the sample's shape alone (:func:`planes_per_draw`), never by a cut: a rank draws only the blocks its slab touches.
GPU ranks draw on their GPU, a few dozen draws a batch (one a plane was 1024 launches a 128³ batch of 8: 51 ms of host
time against a 32 ms step on an H100).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch


def _gen(seed: int, index: int, plane: int, device: torch.device | None = None) -> torch.Generator:
    g = torch.Generator(device=device) if device is not None else torch.Generator()
    return g.manual_seed(((seed * 1_000_003 + index) * 100_003 + plane + 7) & 0x7FFF_FFFF_FFFF)


#: about this many values a draw: enough that a launch's cost is small beside the draw, small enough that the
#: blocks a cut touches beyond its own planes cost little
DRAW_VALUES = 1 << 20


def planes_per_draw(plane_values: int) -> int:
    """How many planes of ``plane_values`` values each one block of a sample holds (the shape's rule, not a
    cut's)."""
    return max(1, DRAW_VALUES // max(1, int(plane_values)))


def most_drawn(shape: Sequence[int], planes: int) -> tuple[int, int]:
    """The most blocks, and the most planes of the sample in them, that :func:`sample_input` draws for a part of
    ``planes`` consecutive planes (along spatial dim 0) of a sample of ``shape`` = (C, *spatial), wherever the part
    lies: the blocks it touches, each whole, over the sample's whole planes (a cut along the other dims draws
    them too). What the planner counts for a rank's draws (gems.plan.predict.gpu_synthetic)."""
    c, *spatial = [int(v) for v in shape]
    k = planes_per_draw(c * math.prod(spatial[1:]))
    if planes < 1:
        return 0, 0
    blocks = min(-(-spatial[0] // k), -(-(planes - 1) // k) + 1)  # a misaligned run of planes touches one more
    return blocks, min(spatial[0], blocks * k)


def draw_bytes(shape: Sequence[int]) -> int:
    """Bytes of the largest block one draw makes for a sample of ``shape`` = (C, *spatial): whole planes, whatever
    part of them a rank keeps (float32). While a reader ahead makes a batch on a GPU, this is what it holds beside
    the batch (:func:`fill_input`); the planner counts it (gems.plan.memory.reader_draw)."""
    c, *spatial = [int(v) for v in shape]
    plane = c * math.prod(spatial[1:])
    return 4 * plane * min(planes_per_draw(plane), spatial[0])


def _part(shape: Sequence[int], slices: Sequence[slice] | None) -> tuple[list[int], list[slice]]:
    """(C, *spatial) of ``shape`` and the slices of every spatial dim (``slices`` padded with whole dims)."""
    c, *spatial = [int(s) for s in shape]
    sl = list(slices) if slices is not None else [slice(0, n) for n in spatial]
    return [c, *spatial], sl + [slice(0, n) for n in spatial[len(sl):]]


def part_shape(shape: Sequence[int], slices: Sequence[slice] | None = None) -> list[int]:
    """The shape (C, *part) of the part ``slices`` of a sample of ``shape`` = (C, *spatial)."""
    (c, *spatial), sl = _part(shape, slices)
    return [c, *(len(range(*s.indices(n))) for s, n in zip(sl, spatial))]


def fill_input(out: torch.Tensor, seed: int, index: int, shape: Sequence[int],
               slices: Sequence[slice] | None = None) -> torch.Tensor:
    """Writes the part ``slices`` of sample ``index``'s input into ``out`` (:func:`part_shape`, on the device the
    blocks are drawn on) and returns it: one block drawn at a time and its planes copied in, so that beside ``out``
    at most one block's draw is alive (:func:`draw_bytes`, which the planner counts
    for a batch being made), not the sample's blocks and their concatenation, nor a batch's samples and
    their stack (one more batch: 2 MiB for the U-Net at 64^3 and a batch of 2). A stepped slice (not a training
    part, which is a slab of consecutive planes) copies its planes out of the block first: two blocks at most."""
    (c, *spatial), sl = _part(shape, slices)
    k = planes_per_draw(c * math.prod(spatial[1:]))
    planes = range(*sl[0].indices(spatial[0]))
    if not planes or out.numel() == 0:
        return out
    dev = out.device if out.device.type != "cpu" else None
    inner = (slice(None), slice(None), *sl[1:])
    if planes.step == 1:
        for b in range(planes.start // k, (planes.stop - 1) // k + 1):
            lo, hi = max(planes.start, b * k), min(planes.stop, (b + 1) * k)
            block = torch.randn([c, min(k, spatial[0] - b * k), *spatial[1:]], generator=_gen(seed, index, b, dev),
                                device=dev)
            out[:, lo - planes.start:hi - planes.start].copy_(block[inner][:, lo - b * k:hi - b * k])
            del block  # freed before the next draw
        return out
    by_block: dict[int, list[tuple[int, int]]] = {}  # a stepped slice (reversed too): its planes, in its order
    for j, p in enumerate(planes):
        by_block.setdefault(p // k, []).append((j, p))
    for b in sorted(by_block):
        block = torch.randn([c, min(k, spatial[0] - b * k), *spatial[1:]], generator=_gen(seed, index, b, dev),
                            device=dev)
        js, ps = zip(*by_block[b])
        out[:, list(js)] = block[inner][:, [p - b * k for p in ps]]
        del block
    return out


def sample_input(seed: int, index: int, shape: Sequence[int], slices: Sequence[slice] | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """Input of ``index`` with ``shape`` = (C, *spatial); ``slices`` picks a part of the spatial dims.

    ``device``: where the blocks are drawn, with that device's generator seeded per (seed, sample, block): on a
    GPU its counter-based Philox generator, so a GPU rank makes its part on the GPU, never on the host, and any
    cut of any mesh gets the same values on the same kind of device (CPU and GPU draw different numbers)."""
    dev = device if device is not None and device.type != "cpu" else None
    return fill_input(torch.empty(part_shape(shape, slices), device=dev), seed, index, shape, slices)


def sample_target(seed: int, index: int, kind: str, num_outputs: int, loss: str,
                  spatial: Sequence[int] = (), slices: Sequence[slice] | None = None) -> torch.Tensor:
    """Target of ``index``: a vector of ``num_outputs`` (mse), a class index (cross-entropy),
    or one class per cell shaped like ``spatial`` (dense), optionally only the part ``slices``."""
    g = _gen(seed, index, -1)
    if kind == "dense":
        full_planes = [torch.randint(0, num_outputs, tuple(spatial[1:]), generator=_gen(seed, index, -2 - d))
                       for d in range(*(slices[0] if slices else slice(0, spatial[0])).indices(spatial[0]))]
        t = torch.stack(full_planes, dim=0)
        if slices:
            t = t[(slice(None), *slices[1:])]
        return t
    if loss == "cross_entropy":
        return torch.randint(0, num_outputs, (), generator=g)
    return torch.rand(num_outputs, generator=g) * 2 - 1


class SyntheticData:
    """The dataset of ``num_samples`` synthetic samples for a model spec; ``offset``: the index of its first
    sample (a held-out validation set is ``offset=`` the training set's size: samples no step trains on)."""

    def __init__(self, spec: object, seed: int, num_samples: int, offset: int = 0,
                 device: torch.device | None = None) -> None:
        self.spec = spec
        self.seed = seed
        self.num_samples = num_samples
        self.offset = offset
        self.device = device  # where the inputs are drawn (sample_input): a GPU rank's own GPU

    def __len__(self) -> int:
        return self.num_samples

    symmetries = 1  # no augmentation (data.augment mirrors files, gems.data.augment)

    def batch(self, indices: Sequence[int], slices: Sequence[slice] | None = None, want_input: bool = True,
              want_target: bool = True, symmetries: Sequence[int] | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        assert symmetries is None, "synthetic samples are not augmented"
        spec: Any = self.spec
        dev = self.device if self.device is not None and self.device.type != "cpu" else None
        # each sample drawn into its place in the batch (fill_input): no sample and its stack alive at once
        x = torch.empty([len(indices), *part_shape(spec.input_shape, slices)], device=dev) \
            if want_input and indices else None
        ys = []
        for n, i in enumerate(indices):
            j = self.offset + i % self.num_samples
            if x is not None:
                fill_input(x[n], self.seed, j, spec.input_shape, slices)
            if want_target:
                ys.append(sample_target(self.seed, j, spec.target, spec.num_outputs, spec.loss, spec.input_shape[1:],
                                        slices if spec.target == "dense" else None))
        y = torch.stack(ys) if ys else None
        return x, y
