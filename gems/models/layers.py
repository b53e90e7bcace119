"""The layers every part of gems shares live in :mod:`gems.layers`; this name is kept for scripts that
import them from here (``from gems.models.layers import batch_context``)."""
from gems.layers import SampleDropout, batch_context, bf16_conv3d_needs_fp32, conv3d_in_fp32, guard_bf16_conv3d  # noqa: F401
