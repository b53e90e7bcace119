"""Every schedule gives the serial losses and gradients, on real gloo worlds.

Cases are batched into one world per size (processes are the slow part on two
cores). Each case trains a few SGD steps; per step the global loss must equal
the serial one (gradient accumulation over the same chunks), the step-0
gradient of every partition on every rank must equal the serial gradient
after the sum over the ``grad`` group, the final parameters must equal the
serial ones, and all copies of a partition (mirrored ranks, replicas) must be
bit-identical.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from _pipeline_worlds import pipeline_cases, serial_case
from gems.testing import run_world


def case(model: str, schedule: str, D: int, m: int = 1, eta: int | None = None, R: int = 1, B: int = 8,
         checkpoint: bool = False, trace: bool = True, steps: int = 3, balance_by: str = "memory") -> dict[str, Any]:
    return dict(model=model, schedule=schedule, D=D, R=R, m=m, eta=eta, B=B, checkpoint=checkpoint, trace=trace,
                steps=steps, balance_by=balance_by)


WORLD2 = [  # D = 2
    case("cosmoflow", "lp", 2),
    case("cosmoflow", "gpipe", 2, m=4),
    case("cosmoflow", "1f1b", 2, m=4, checkpoint=True),
    case("cosmoflow", "mast", 2),
    case("cosmoflow", "mast", 2, m=2, checkpoint=True),  # Chimera: micro-batches inside each direction
    case("cosmoflow", "master", 2, eta=4),
    case("cosmoflow", "master", 2, eta=3, B=6, trace=False),  # odd eta; shapes learnt from headers
    case("resnet_bn", "mast", 2),
    case("resnet_bn", "1f1b", 2, m=2, checkpoint=True),  # recomputation must not update BN statistics twice
    case("resnet_gn", "master", 2, m=2, eta=2, trace=False),
    case("resnet_gn", "1f1b", 2, m=2, balance_by="time", steps=2),  # measured balance: rank 0's is broadcast
]
WORLD3 = [  # odd D: the middle rank holds one partition for both directions
    case("cosmoflow", "mast", 3, B=6),
    case("resnet_gn", "master", 3, eta=3, B=6, checkpoint=True),
]
WORLD4 = [  # D = 4, and R = 2 x D = 2 (GEMS-Hybrid)
    case("cosmoflow", "lp", 4, steps=2),
    case("cosmoflow", "gpipe", 4, m=4, steps=2),
    case("cosmoflow", "1f1b", 4, m=4, steps=2),
    case("cosmoflow", "mast", 4, m=2, steps=2),
    case("resnet_gn", "master", 4, eta=4, checkpoint=True, trace=False, steps=2),
    case("cosmoflow", "mast", 2, R=2, steps=2),
    case("resnet_bn", "master", 2, m=2, eta=2, R=2, B=16, steps=2),
]


def check(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    world = len(results)
    for ci, c in enumerate(cases):
        label = f"{c['model']}/{c['schedule']} D={c['D']} R={c['R']} m={c['m']} eta={c['eta']} ckpt={c['checkpoint']}"
        per_rank = [results[r][ci] for r in range(world)]
        balance = per_rank[0]["balance"]
        assert all(p["balance"] == balance for p in per_rank), label
        assert all(p["samples_per_step"] == c["B"] // c["R"] for p in per_rank), label
        ref = serial_case(c, balance)
        for p in per_rank:
            torch.testing.assert_close(p["losses"], ref["losses"], rtol=1e-5, atol=1e-7, msg=lambda m: f"{label}: {m}")
        copies: dict[int, list[list[torch.Tensor]]] = {}
        for p in per_rank:
            for i, grads in p["grads0"].items():
                for g, h in zip(grads, ref["grads0"][i], strict=True):
                    torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} grad of part {i}: {m}")
                for w, v in zip(p["params"][i], ref["params"][i], strict=True):
                    torch.testing.assert_close(w, v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} param of part {i}: {m}")
                copies.setdefault(i, []).append(p["params"][i])
        held = sorted(copies)
        assert held == list(range(c["D"])), label
        mirrored = c["schedule"] in ("mast", "master")
        for i, sets in copies.items():
            expect = c["R"] * (2 if mirrored and 2 * i != c["D"] - 1 else 1)
            assert len(sets) == expect, f"{label}: partition {i} has {len(sets)} copies, expected {expect}"
            for other in sets[1:]:
                assert all(torch.equal(a, b) for a, b in zip(sets[0], other)), f"{label}: copies of part {i} differ"


@pytest.mark.parametrize("world,cases", [(2, WORLD2), (3, WORLD3), (4, WORLD4)], ids=["D2", "D3", "D4-and-R2xD2"])
def test_every_schedule_matches_serial(world: int, cases: list[dict[str, Any]]) -> None:
    check(run_world(pipeline_cases, world, cases, timeout=300), cases)
