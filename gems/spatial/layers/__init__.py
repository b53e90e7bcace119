"""Spatial versions of the layers of a CNN trunk, each exact against its serial self, one module per family.

Every layer here takes this rank's part of an activation and returns its part
of the output, split along the cut dims like the input (``np.array_split`` of
the output's global extent). It holds the *same* parameter and buffer
objects as the layer it replaces, under the same names, so the state dict and
the optimizer see the serial model. Which torch layer becomes which is
registered in one place, :mod:`gems.spatial.apply`.

* :mod:`~gems.spatial.layers.base`: the base class and what every layer shares.
* :mod:`~gems.spatial.layers.window`: convolutions and pools own the output
  cells in their range and read exactly the input window those cells need
  (:class:`gems.spatial.geometry.Window`), fetched by the halo exchange;
  padding at the sample's edges is applied explicitly, so any kernel, stride,
  padding, dilation and ``ceil_mode`` is exact, with uneven parts and halos
  wider than a neighbour. With ``SpatialContext.overlap`` the interior is
  computed while halos are in flight, then the boundary slabs.
  Convolutions and average pools that count padding (linear in the input,
  zero padding) take a cheaper, equally exact route where the cut allows it
  (symmetric padding, parts aligned with the stride): the op runs on the
  part as it is, with its own padding along the cut dims, while the halos
  travel; the boundary planes then get the op over a window of received
  halo cells added (:mod:`gems.spatial.halo`). Nothing of the part's size is
  copied, forward or backward. Measured on CosmoFlow 128^3 at S=2 (CPU), the
  window copies, zero fills and gradient scatters of the general route cost
  more than the halo exchange itself.
* :mod:`~gems.spatial.layers.conv`: convolutions go through
  :func:`gems.spatial.conv_backend.conv_nd`, which keeps torch off its slow
  reference kernel for slab shapes it would send there (13x slower on
  CosmoFlow's third convolution at S=2).
* :mod:`~gems.spatial.layers.pool`: max and average pools (window layers), and
  the global pools whose output is whole on every part.
* :mod:`~gems.spatial.layers.transpose`: transposed convolutions gather the
  inputs that feed their outputs and crop.
* :mod:`~gems.spatial.layers.upsample`: upsampling uses torch's index rule and
  interpolates along each dim.
* :mod:`~gems.spatial.layers.norm`: BatchNorm (and GroupNorm, InstanceNorm)
  sum their statistics over the parts with a differentiable all-reduce: global
  statistics, exact. ``bn_stats="local"`` keeps per-part BatchNorm statistics
  (not equal to serial; :mod:`gems.spatial.apply`).
* :mod:`~gems.spatial.layers.pointwise`: element-wise layers run unchanged;
  :class:`~gems.spatial.layers.pointwise.SpatialSampleDropout` slices the mask
  the serial run would draw.
* :mod:`~gems.spatial.layers.gather`: where the trunk ends, every part gets the
  full activation.

A rank whose part of an activation is empty (an activation smaller than the
number of parts, deep in the trunk) returns an empty part that stays in the
autograd graph, so it still sends and receives its share of halo gradients.
"""
