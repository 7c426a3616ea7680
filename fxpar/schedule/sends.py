"""When a rank may let go of a tensor it sent: the point in its list after which waiting on the send cannot block.

A SEND posts ``isend`` and the rank goes on; the tensor stays alive until the send completes, which over gloo needs
the receiver to have posted the matching receive. Waiting on every send only at the end of the window holds one
message per microbatch for the whole window: under the asynchronous schedules (a window over every batch of a run)
that grows with the run. Waiting on a send early is safe only where the receiver's matching RECV is known to have
completed, else the wait may block a rank the receiver itself waits for (a deadlock at ``p > 2``).

The rule (:func:`send_releases`): a rank learns how far each other rank has come only through the messages it
receives, so every rank keeps a vector clock over the schedule -- per rank, how many of that rank's actions are known
to have run. A RECV merges the sender's clock at its SEND. Right after a RECV, the rank waits on (and drops) every
send of its own whose matching RECV the merged clock shows done: the receiver had completed that receive before it
sent what was just received (directly, or through other ranks), so the data has gone and the wait returns at once.
The sends no RECV releases are waited at the window's end. In 1F1B's steady state a stage holds the
activations it sent until the gradient of a later microbatch comes back, and the gradients it sent until the next
forward input arrives: a bound set by the schedule's depth, not by the window's length.

Collectives (``RG``) also order ranks, but the rule ignores them: it releases fewer sends, never an unsafe one. The
runtime (``fxpar/runtime/executor.py``) and the memory walk (``fxpar.program``'s step sequence for
``cost_models.step_memory``, and Wavelet's wave timelines) follow this table.
"""
from __future__ import annotations

from fxpar.schedule.ir import RECVS, SENDS, Action, ActionKind

__all__ = ["send_releases", "message_key", "sent_until"]

_K = ActionKind


def message_key(a: Action, rank: int) -> tuple:
    """``(channel, consumer stage, microbatch, src, dst)`` of a SEND or RECV on ``rank``: equal for the two ends of
    one message."""
    if a.kind == _K.SEND_F:
        return ("F", a.stage + 1, a.microbatch, rank, a.peer)
    if a.kind == _K.SEND_B:
        return ("B", a.stage - 1, a.microbatch, rank, a.peer)
    return ("F" if a.kind == _K.RECV_F else "B", a.stage, a.microbatch, a.peer, rank)


def send_releases(actions: dict) -> dict:
    """``{rank: {index of a RECV in its list: [indices of the rank's SENDs it waits on right after it]}}`` for
    per-rank action lists ``actions`` (``Schedule.actions``, keyed by the same ranks the actions' peers name).

    A send that no RECV releases (the window's last messages, or a schedule whose lists do not run to their end
    point to point) is absent: the runtime waits on it at the window's end."""
    ranks = sorted(actions)
    where = {}                                    # message key -> (receiving rank, index of its RECV)
    for r in ranks:
        for j, a in enumerate(actions[r]):
            if a.kind in RECVS:
                where[message_key(a, r)] = (r, j)
    clock = {r: dict.fromkeys(ranks, 0) for r in ranks}       # per rank: actions of every rank known to have run
    sent = {}                                     # message key -> the sender's clock when it sent
    pending = {r: [] for r in ranks}              # per rank: [(receiver, its RECV index, SEND index)] not released
    out = {r: {} for r in ranks}
    ptr = dict.fromkeys(ranks, 0)
    moved = True
    while moved:                                  # a dry run in any order the messages allow (sends never block)
        moved = False
        for r in ranks:
            acts = actions[r]
            while ptr[r] < len(acts):
                j, a = ptr[r], acts[ptr[r]]
                if a.kind in RECVS:
                    key = message_key(a, r)
                    if key not in sent:
                        break                     # its message is not sent yet: another rank first
                    for q, n in sent.pop(key).items():
                        clock[r][q] = max(clock[r][q], n)
                clock[r][r] = j + 1
                if a.kind in SENDS:
                    key = message_key(a, r)
                    sent[key] = dict(clock[r])
                    if key in where:
                        pending[r].append((*where[key], j))
                elif a.kind in RECVS:
                    done = [p for p in pending[r] if p[1] < clock[r][p[0]]]
                    if done:
                        out[r][j] = [p[2] for p in done]
                        pending[r] = [p for p in pending[r] if p[1] >= clock[r][p[0]]]
                ptr[r] += 1
                moved = True
    return out


def sent_until(acts: list, releases: dict) -> dict:
    """For one rank's list ``acts`` and its part of :func:`send_releases`: ``{index of a compute action whose output a
    later SEND sends: index of the RECV after which the rank waits on that send, or None (the window's end)}``. The
    output is F's activations for ``SF``, B's (or I's) input gradients for ``SB``."""
    free = {k: j for j, ks in releases.items() for k in ks}
    made, out = {}, {}
    for j, a in enumerate(acts):
        if a.kind == _K.F:
            made[("F", a.stage, a.microbatch)] = j
        elif a.kind in (_K.B, _K.I):
            made[("B", a.stage, a.microbatch)] = j
        elif a.kind in SENDS:
            src = made.get(("F" if a.kind == _K.SEND_F else "B", a.stage, a.microbatch))
            if src is not None:
                out[src] = free.get(j)
    return out
