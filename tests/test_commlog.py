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


def test_a_receive_holds_what_the_rank_sends_its_peer_on_another_communicator() -> None:
    """The runtime that hung every schedule on an H200, in miniature: each rank posts its receive on the
    communicator of one link, then sends on another link's. Communicators that ran independently passed it;
    NCCL does not promise they do (one ordered stream per pair of ranks)."""
    logs = {r: [post(0, "recv", 1 - r, f"g:link{1 - r}{r}", [0, 1], batch=0),
                post(1, "send", 1 - r, f"g:link{r}{1 - r}", [0, 1], batch=1), wait(0)] for r in (0, 1)}
    for strict in (False, True):
        with pytest.raises(OrderError, match="pair 0-1 stream is held by irecv"):
            replay(logs, strict_sends=strict)


def test_a_collective_waits_behind_a_receive_from_one_of_its_members() -> None:
    """Rank 0 receives from rank 1, then joins a sum with it on another communicator; rank 1 sums first, then
    sends: under NCCL rank 0's sum may wait behind its receive, and rank 1's send behind its sum."""
    logs = {0: [post(0, "recv", 1, "g:line", [0, 1], batch=0), post(1, "coll", None, "g:grad", [0, 1]), wait(0, 1)],
            1: [post(0, "coll", None, "g:grad", [0, 1]), post(1, "send", 0, "g:line", [0, 1], batch=1), wait(0, 1)]}
    with pytest.raises(OrderError, match="hang"):
        replay(logs, strict_sends=True)
    # in one order on both ranks it completes
    logs[0] = [post(0, "coll", None, "g:grad", [0, 1]), post(1, "recv", 1, "g:line", [0, 1], batch=0), wait(0, 1)]
    assert replay(logs, strict_sends=True) == {"ops": 4, "messages": 1, "collectives": 2}


def test_halo_batches_with_every_neighbour_pass() -> None:
    """Three parts in a ring, each exchange one batch with both neighbours (the halo's pattern), twice, with a
    sum between: every batch is a meeting."""
    def rank(r: int) -> list[dict]:
        left, right = (r - 1) % 3, (r + 1) % 3
        out, i = [], 0
        for b in range(2):
            ops = [post(i, "send", left, "g:sp", [0, 1, 2], batch=b), post(i + 1, "recv", left, "g:sp", [0, 1, 2], batch=b),
                   post(i + 2, "send", right, "g:sp", [0, 1, 2], batch=b), post(i + 3, "recv", right, "g:sp", [0, 1, 2], batch=b)]
            out += ops + [wait(i, i + 1, i + 2, i + 3), post(i + 4, "coll", None, "g:sp", [0, 1, 2])]
            i += 5
        return out
    for strict in (False, True):
        assert replay({r: rank(r) for r in range(3)}, strict_sends=strict)["messages"] == 12


def _golden_logs() -> dict[str, dict[int, list[dict]]]:
    import gzip
    import json
    from pathlib import Path

    path = Path(__file__).parent / "golden" / "commlog" / "runtime-78aa722.json.gz"
    with gzip.open(path, "rt") as f:
        return {label: {int(r): ev for r, ev in per.items()} for label, per in json.load(f).items()}


def test_the_replay_flags_the_runtime_that_hung_on_the_h200() -> None:
    """What every rank of gems at 78aa722 issued (recorded over gloo, one step of every registered schedule at
    D = 2, 1F1B at D = 4 and MAST in R x D, D x S and R x D x S; tests/golden/commlog): every D = 2 schedule hung
    at step 0 on an H200 (../shared/measurements/h200-2026-11-26.json). The replay must call every pipelined
    log a hang, and pass the data-parallel and spatial runs that completed there."""
    logs = _golden_logs()
    # the schedules registered when the log was recorded (78aa722), each in it: the log is that runtime's, which
    # cannot be recorded again, so a schedule registered since has none here (its replay: test_pipeline_transparency)
    recorded = {"lp", "gpipe", "1f1b", "mast", "master", "interleaved1f1b", "zbh1", "interleavedzb", "loopedbfs"}
    assert {label.split()[0] for label in logs} >= recorded
    for label, per in logs.items():
        for strict in (False, True):
            if label.startswith("none"):  # R = 2 and S = 2 without a pipeline: they ran on the H200
                assert replay(per, strict_sends=strict)["ops"] > 0, label
            else:
                with pytest.raises(OrderError, match="hang"):
                    replay(per, strict_sends=strict)


def test_a_graphs_launches_replay_in_its_chains_one_order_and_an_order_only_that_serialisation_hangs_is_caught() -> None:
    """Three ranks, each a sum with one neighbour and then one with the other (three communicators: rank 0 sums with
    1 then 2, rank 1 with 2 then 0, rank 2 with 0 then 1). Eagerly each sum runs on its communicator's and its pair's
    streams, none of which the other sum shares, so every order completes. Captured, a rank's launches form one chain,
    each after the one before it is done: each rank's first sum waits for a peer whose first sum is another, around
    the circle. The strict replay calls that a hang; launched in one global order the same chains replay. The eager
    work after the graph waits for the graph's last launch (the capture's end joins the chain)."""
    comms = {(0, 1): "g:a", (1, 2): "g:b", (0, 2): "g:c"}

    def sum_with(i: int, r: int, peer: int, graph: bool) -> dict:
        pair = (min(r, peer), max(r, peer))
        ev = post(i, "coll", None, comms[pair], list(pair))
        return {**ev, "graph": 0, "chained": True} if graph else ev

    def logs(order: dict[int, list[int]], graph: bool) -> dict[int, list[dict]]:
        return {r: [sum_with(i, r, p, graph) for i, p in enumerate(peers)] + [wait(0, 1)] for r, peers in order.items()}

    circle = {0: [1, 2], 1: [2, 0], 2: [0, 1]}
    assert replay(logs(circle, graph=False), strict_sends=True)["collectives"] == 6
    with pytest.raises(OrderError, match="hang") as hung:
        replay(logs(circle, graph=True), strict_sends=True)
    assert "graph chain stream is held by all_reduce #0" in str(hung.value)
    ordered = {0: [1, 2], 1: [0, 2], 2: [0, 1]}  # every rank meets (0,1), then (0,2), then (1,2) in one order
    assert replay(logs(ordered, graph=True), strict_sends=True)["collectives"] == 6
    # after the graph, eager work waits for its last launch: each rank receives from one neighbour inside its graph,
    # then sends to the other eagerly; on the eager streams alone the sends go first and all complete
    def ring(graph: bool) -> dict[int, list[dict]]:
        out = {}
        for r in range(3):
            src, dst = (r + 1) % 3, (r + 2) % 3
            recv = post(0, "recv", src, f"p:s:{min(r, src)}-{max(r, src)}", sorted([r, src]))
            out[r] = [{**recv, "graph": 0, "chained": True} if graph else recv,
                      post(1, "send", dst, f"p:s:{min(r, dst)}-{max(r, dst)}", sorted([r, dst])), wait(0, 1)]
        return out

    assert replay(ring(graph=False), strict_sends=True)["messages"] == 3
    with pytest.raises(OrderError, match="hang"):
        replay(ring(graph=True), strict_sends=True)
