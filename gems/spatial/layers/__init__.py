"""Spatial versions of the layers of a CNN trunk, one module a family, each exact against its serial self.

A spatial layer takes this rank's part of an activation and returns its part of the output, split along the cut dims
like the input, and holds the very parameter and buffer objects of the layer it replaces, under the same names, so
the state dict and the optimizer see the serial model. A rank whose part is empty (deep in the trunk) returns an
empty part that stays in the autograd graph, so it still trades its share of halo gradients.
"""
