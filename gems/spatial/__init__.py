"""Spatial parallelism: one sample cut into parts across ranks, exact against serial.

``SpatialContext`` says where this rank's part lies; ``apply_spatial`` turns a model's layers into their spatial
versions (halo exchange as autograd functions, global BatchNorm statistics, a gather where the trunk ends).
Parameter gradients stay per rank: the caller sums them over the spatial group, as for every strategy.
"""
from gems.cut_rules import CannotCut, register_container, register_layer, register_pointwise
from gems.shapes import split_bounds
from gems.spatial.apply import apply_spatial, gather_point
from gems.spatial.context import SpatialContext

__all__ = ["SpatialContext", "apply_spatial", "gather_point", "register_layer", "register_container",
           "register_pointwise", "CannotCut", "split_bounds"]
