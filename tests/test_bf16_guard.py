"""bf16 Conv3d on CPU ranks: torch 2.13's oneDNN weight gradient is wrong for inputs 2 cells deep (it reads
memory it never wrote). gems computes those convolutions in fp32; their gradients must be the same on every
run, whatever the recycled memory holds, and match an fp32 reference to bf16 rounding."""
import torch
from torch import nn

from gems.models.layers import guard_bf16_conv3d
from gems.spatial.conv_backend import conv_nd


def _grads(forward, conv, x0, reps=5):
    out = []
    for _ in range(reps):
        junk = [torch.full((1 << 20,), float("nan")) for _ in range(30)]  # the heap holds NaN when freed
        del junk
        x = x0.clone().requires_grad_(True)
        conv.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = forward(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        out.append([x.grad.float().clone(), conv.weight.grad.clone(), conv.bias.grad.clone()])
    return out


def _reference(conv, x0):
    x = x0.float().clone().requires_grad_(True)
    conv.zero_grad()
    y = nn.functional.conv3d(x, conv.weight, conv.bias, conv.stride, conv.padding)
    y.bfloat16().float().square().sum().backward()
    return [x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad.clone()]


def test_bf16_conv3d_on_two_deep_inputs_is_deterministic_and_right():
    torch.manual_seed(0)
    for shape in [(2, 16, 2, 2, 2), (2, 16, 2, 4, 3), (2, 8, 4, 2, 2)]:
        plain = nn.Conv3d(shape[1], 16, 3, padding=1)
        guarded = nn.Conv3d(shape[1], 16, 3, padding=1)
        guarded.load_state_dict(plain.state_dict())
        assert guard_bf16_conv3d(nn.Sequential(guarded)) == 1
        assert isinstance(guarded, nn.Conv3d) and list(guarded.state_dict()) == ["weight", "bias"]
        x0 = torch.randn(shape).bfloat16()
        ref = _reference(guarded, x0)
        c = guarded
        for label, fwd in [("serial layer", guarded),
                           ("spatial conv_nd", lambda x: conv_nd(x, c.weight, c.bias, c.stride, c.padding, c.dilation,
                                                                 c.groups))]:
            runs = _grads(fwd, guarded, x0)
            for r in runs[1:]:
                for a, b in zip(runs[0], r):
                    assert torch.equal(a, b), f"{label} {shape}: gradients differ between identical runs"
            for a, b in zip(runs[0], ref):
                assert torch.isfinite(a).all()
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item(),
                                           msg=lambda m: f"{label} {shape}: {m}")
