"""The NCCL replay itself (gems.commlog.replay), on hand-written logs: what it must call a hang, a mismatch or
a pass. (The logs of real runs are replayed by the transparency, spatial and whole-run tests.)"""
from __future__ import annotations

import pytest

from gems.commlog import OrderError, replay


def post(i: int, kind: str, peer: int | None, comm: str, ranks: list[int], nbytes: int = 8, batch: int | None = None,
         fn: str | None = None) -> dict:
    return {"e": "post", "id": i, "kind": kind, "fn": fn or {"send": "isend", "recv": "irecv"}.get(kind, "all_reduce"),
            "comm": comm, "ranks": ranks, "peer": peer, "batch": batch, "bytes": nbytes, "dtype": "float32"}


def wait(*ids: int) -> dict:
    return {"e": "wait", "ids": list(ids)}


PAIR = "p:1:0-1"


def test_receives_posted_ahead_of_sends_on_one_stream_hang() -> None:
    """Today's bug, in miniature: each rank posts its receive, then its send, on the pair's one stream."""
    logs = {0: [post(0, "recv", 1, PAIR, [0, 1]), post(1, "send", 1, PAIR, [0, 1]), wait(0)],
            1: [post(0, "recv", 0, PAIR, [0, 1]), post(1, "send", 0, PAIR, [0, 1]), wait(0)]}
    with pytest.raises(OrderError, match="hang"):
        replay(logs)


def test_a_batch_starts_its_sends_with_its_receives() -> None:
    logs = {r: [post(0, "recv", 1 - r, "g:1", [0, 1], batch=0), post(1, "send", 1 - r, "g:1", [0, 1], batch=0),
                wait(0, 1)] for r in (0, 1)}
    assert replay(logs) == {"ops": 4, "messages": 2, "collectives": 0}
    assert replay(logs, strict_sends=True)["messages"] == 2


def test_sends_first_pass_leniently_and_fail_strictly() -> None:
    """Both send first, then receive, each op alone: fine while sends complete on their own; with sends that
    wait for their receive (NCCL's large messages) each stream is held by its send."""
    logs = {r: [post(0, "send", 1 - r, PAIR, [0, 1]), post(1, "recv", 1 - r, PAIR, [0, 1]), wait(1)] for r in (0, 1)}
    assert replay(logs)["messages"] == 2
    with pytest.raises(OrderError, match="hang"):
        replay(logs, strict_sends=True)


def test_messages_match_by_order_not_by_tag() -> None:
    logs = {0: [post(0, "send", 1, PAIR, [0, 1], nbytes=8), post(1, "send", 1, PAIR, [0, 1], nbytes=16)],
            1: [post(0, "recv", 0, PAIR, [0, 1], nbytes=16), post(1, "recv", 0, PAIR, [0, 1], nbytes=8), wait(0, 1)]}
    with pytest.raises(OrderError, match="by order, not by tag"):
        replay(logs)


def test_collectives_in_different_orders_are_named() -> None:
    logs = {0: [post(0, "coll", None, "g:0", [0, 1], fn="all_reduce"), post(1, "coll", None, "g:0", [0, 1], fn="broadcast")],
            1: [post(0, "coll", None, "g:0", [0, 1], fn="broadcast"), post(1, "coll", None, "g:0", [0, 1], fn="all_reduce")]}
    with pytest.raises(OrderError, match="different collectives"):
        replay(logs)


def test_a_message_nobody_receives_is_named() -> None:
    logs = {0: [post(0, "send", 1, PAIR, [0, 1])], 1: [post(0, "coll", None, PAIR, [0, 1])]}
    with pytest.raises(OrderError):
        replay(logs)
