"""ExaLearn's CosmoFlow universes as NERSC publishes them (``cosmoUniverse_2019_05_4parE``): one ``.hdf5`` file
a universe, ``full`` (N, N, N, C) channels LAST (int16 counts, 4 redshifts; any integer or float type is read),
``unitPar`` the 4 normalised parameters. Read where they lie, as crops of ``data.crop`` (the paper's 512^3
whole-universe study and MLPerf's 128^3 crops from the same files): a rank's depth slab is one contiguous run
of bytes, read by position; the channels are moved to the front on the rank's device, after the copy
(gems.data.hdf5.Counts). ``gems data synth data.kind=cosmology`` writes this layout."""
from __future__ import annotations

from gems.data.layouts import register
from gems.data.layouts._h5 import HDF5Layout


@register
class ExaLearn(HDF5Layout):
    name = "exalearn"
    about = "ExaLearn's universes: .hdf5 (or .h5) files, `full` (N, N, N, C) channels last and `unitPar`"
    channels = "last"
    extension = ".hdf5"
    published_edge = 512  # cosmoUniverse_2019_05_4parE's universes
