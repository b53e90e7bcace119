"""gems's own layout: one ``.h5`` file a sample, ``full`` (C, D, H, W) (or (C, H, W)) channels first, of any
integer or float type (int16 counts from ``gems data synth``), and ``unitPar``. What ``gems data synth`` (the
lognormal kind) writes and ``gems data convert`` converts into; a depth slab is C runs, one a channel."""
from __future__ import annotations

from gems.data.layouts import register
from gems.data.layouts._h5 import HDF5Layout


@register
class Own(HDF5Layout):
    name = "gems"
    about = "gems's own .h5 files: `full` (C, D, H, W) channels first and `unitPar` (gems data synth)"
    channels = "first"
    extension = ".h5"
    stamp = True

    def named(self, name: str) -> bool:
        return name.endswith(".h5")
