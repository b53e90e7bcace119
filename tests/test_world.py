import pytest
import torch
from _worlds import allreduce_rank, fail_on_one

from gems.launch.world import run_world


def test_run_world_allreduce():
    assert run_world(allreduce_rank, 3) == [6.0, 6.0, 6.0]


def test_run_world_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1"):
        run_world(fail_on_one, 2, timeout=60)


@pytest.mark.parametrize("skips", [3, 60])
def test_a_cut_learns_the_layout_of_any_number_of_skips_from_its_header(skips):
    """A pipeline whose cut cannot be traced learns the packed skips' layout from the first step's header, which
    is sent after its length: 60 skips (313 fields; the fixed header of 64 stopped the sender and left the
    receiver waiting) train as one process does."""
    from _worlds import many_skips, many_skips_pipeline

    (l0, g0), (l1, g1) = run_world(many_skips_pipeline, 2, skips, timeout=120)
    seq, x, y, loss = many_skips(skips)
    want = loss(seq(x), y, 2)
    want.backward()
    assert l0 == 0.0 and l1 == pytest.approx(want.item(), rel=1e-6)
    for got, ref in zip(g0 + g1, [p.grad for p in seq.parameters()], strict=True):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_stage_frees_a_send_once_its_delivery_is_known(checkpoint):
    """Over gloo a send's work says it completed only once waited for: a stage held every buffer it sent until the
    end of the step (the first stage its activations, which undid recomputation's saving; the second its input
    gradients). A send is freed once a message its receiver made after needing it has come back
    (ExchangePlan.delivered): under 1F1B at D = 2 each stage holds one at most at each backward (four and three
    before)."""
    from _worlds import sends_held

    first, second = run_world(sends_held, 2, checkpoint, timeout=120)
    assert len(first) == len(second) == 8 and max(first) <= 1 and max(second) <= 1, (first, second)
