"""Structural checks of a Schedule, before any simulation: coverage, pairing, placement, versions.

``validate(schedule)`` raises :class:`ScheduleValidationError` listing every broken rule;
``find_problems(schedule)`` returns the same list of plain-language problems. The rules:

1. Every (stage, microbatch) has exactly one F and one B, on the same rank, F first, on a rank that
   holds the stage (``stage_to_rank``); at most one W, after its B on that rank.
2. Every F of stage s > 0 has its input on its rank before it (F of s-1 earlier there, or an RF);
   every B of a non-last stage likewise has its output gradient (B of s+1 earlier there, or an RB).
3. Every SEND has exactly one matching RECV at its peer and vice versa, and on each channel
   (src, dst, activations|gradients) the sends and the receives come in the same order -- the order
   in which a runtime with ordered point-to-point messages (NCCL, gloo with one tag) pairs them.
   A SEND comes after the compute that makes its tensor, on the same rank.
4. SYNC s only on ranks holding s, equally often on every replica, and every pair of ranks meets
   their shared SYNCs in the same order. A replicated stage is SYNCed before it is STEPped.
5. Versions: either every F/B/W of a stage has ``@v`` or none does; a B (W) uses its F's version;
   ``STEP s@v`` on a rank numbers 1, 2, 3, ... . Without versions (synchronous): each rank STEPs each
   stage it holds once, after all that stage's B/W there.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from fxpar.schedule.errors import ScheduleValidationError
from fxpar.schedule.ir import COMPUTE, RECVS, SENDS, ActionKind, Schedule

__all__ = ["validate", "find_problems"]

_K = ActionKind


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleValidationError` naming every broken rule; return None if there is none."""
    problems = find_problems(schedule)
    if problems:
        raise ScheduleValidationError(problems)


def find_problems(schedule: Schedule) -> list[str]:
    out: list[str] = []
    acts = schedule.actions
    pos: dict[tuple, list[tuple[int, int]]] = defaultdict(list)   # (kind, stage, mb) -> [(rank, index)]
    for r, seq in acts.items():
        for j, a in enumerate(seq):
            if a.rank != r:
                out.append(f"rank {r} step {j}: {a} says rank {a.rank}")
            if a.stage >= schedule.n_stages:
                out.append(f"rank {r} step {j}: {a.short()} names stage {a.stage}, but there are {schedule.n_stages}")
            elif a.kind in COMPUTE or a.kind in (_K.SYNC, _K.STEP):
                if r not in schedule.stage_to_rank.get(a.stage, ()):
                    out.append(f"rank {r} step {j}: {a.short()} runs stage {a.stage}, which lives on ranks "
                               f"{schedule.stage_to_rank.get(a.stage, ())}, not rank {r}")
            if a.kind in COMPUTE:
                pos[(a.kind, a.stage, a.microbatch)].append((r, j))
    out += _coverage(schedule, pos)
    out += _data_deps(schedule)
    out += _pairs(schedule)
    out += _collectives(schedule)
    out += _versions(schedule, pos)
    return out


def _coverage(schedule: Schedule, pos) -> list[str]:
    out = []
    for s in range(schedule.n_stages):
        for i in range(schedule.n_microbatches):
            f, b, w = pos.get((_K.F, s, i), []), pos.get((_K.B, s, i), []), pos.get((_K.W, s, i), [])
            for kind, found in (("F", f), ("B", b)):
                if len(found) != 1:
                    out.append(f"{kind}{s}.{i} appears {len(found)} times (at {found}); it must appear exactly once")
            if len(f) == 1 and len(b) == 1:
                (rf, jf), (rb, jb) = f[0], b[0]
                if rf != rb:
                    out.append(f"F{s}.{i} runs on rank {rf} but B{s}.{i} on rank {rb}: a backward needs its own "
                               f"forward's activations, so both must be on one rank")
                elif jb < jf:
                    out.append(f"B{s}.{i} (rank {rb} step {jb}) comes before its F{s}.{i} (step {jf})")
                if len(w) > 1 or (w and (w[0][0] != rb or w[0][1] < jb)):
                    out.append(f"W{s}.{i} at {w} must appear at most once, after B{s}.{i} on rank {rb}")
    return out


def _data_deps(schedule: Schedule) -> list[str]:
    out, n = [], schedule.n_stages
    for r, seq in schedule.actions.items():
        have: set[tuple] = set()
        for j, a in enumerate(seq):
            s, i = a.stage, a.microbatch
            if a.kind == _K.F and s > 0 and ("in", s, i) not in have:
                out.append(f"rank {r} step {j}: {a.short()} has no input: neither F{s - 1}.{i} nor RF{s}.{i}<SRC "
                           f"comes before it on rank {r}")
            if a.kind == _K.B and s < n - 1 and ("grad", s, i) not in have:
                out.append(f"rank {r} step {j}: {a.short()} has no output gradient: neither B{s + 1}.{i} nor "
                           f"RB{s}.{i}<SRC comes before it on rank {r}")
            if a.kind in SENDS and (a.kind.value[1], s, i) not in have:
                out.append(f"rank {r} step {j}: {a.short()} sends a tensor that {a.kind.value[1]}{s}.{i} has not made "
                           f"yet on rank {r}")
            if a.kind in COMPUTE:
                have.add((a.kind.value, s, i))
            if a.kind == _K.F or a.kind == _K.RECV_F:
                have.add(("in", s + 1 if a.kind == _K.F else s, i))
            if a.kind == _K.B or a.kind == _K.RECV_B:
                have.add(("grad", s - 1 if a.kind == _K.B else s, i))
    return out


def _pairs(schedule: Schedule) -> list[str]:
    out = []
    sends: dict[tuple, list] = defaultdict(list)   # (src, dst, channel) -> [(consumer stage, mb, step)]
    recvs: dict[tuple, list] = defaultdict(list)
    for r, seq in schedule.actions.items():
        for j, a in enumerate(seq):
            if a.kind in SENDS | RECVS:
                if a.peer == r or a.peer not in schedule.actions:
                    out.append(f"rank {r} step {j}: {a.short()} names peer rank {a.peer}, which is "
                               f"{'itself' if a.peer == r else 'not a rank of this schedule'}")
                    continue
                ch = "F" if a.kind in (_K.SEND_F, _K.RECV_F) else "B"
                if a.kind in SENDS:
                    cons = a.stage + 1 if ch == "F" else a.stage - 1
                    sends[(r, a.peer, ch)].append((cons, a.microbatch, j))
                else:
                    recvs[(a.peer, r, ch)].append((a.stage, a.microbatch, j))
    for key in sorted(set(sends) | set(recvs)):
        src, dst, ch = key
        sk = [(s, i) for s, i, _ in sends.get(key, [])]
        rk = [(s, i) for s, i, _ in recvs.get(key, [])]
        sname, rname = ("SF", "RF") if ch == "F" else ("SB", "RB")
        d = -1 if ch == "F" else 1
        for s, i in (Counter(sk) - Counter(rk)).elements():
            out.append(f"rank {src} sends {sname}{s + d}.{i}>{dst} but rank {dst} never receives it "
                       f"(add {rname}{s}.{i}<{src} to rank {dst})")
        for s, i in (Counter(rk) - Counter(sk)).elements():
            out.append(f"rank {dst} waits for {rname}{s}.{i}<{src} but rank {src} never sends it "
                       f"(add {sname}{s + d}.{i}>{dst} to rank {src})")
        if Counter(sk) == Counter(rk) and sk != rk:
            k = next(n for n, (x, y) in enumerate(zip(sk, rk)) if x != y)
            out.append(f"channel rank {src} -> rank {dst} ({'activations' if ch == 'F' else 'gradients'}): message "
                       f"#{k} is sent as {sname}{sk[k][0] + d}.{sk[k][1]} but received as {rname}{rk[k][0]}.{rk[k][1]}; "
                       f"sends and receives must come in the same order")
    return out


def _collectives(schedule: Schedule) -> list[str]:
    out = []
    seqs = {r: [a.stage for a in seq if a.kind == _K.SYNC] for r, seq in schedule.actions.items()}
    for s, ranks in schedule.stage_to_rank.items():
        counts = {r: seqs.get(r, []).count(s) for r in ranks}
        if len(set(counts.values())) > 1:
            out.append(f"SYNC{s} appears {counts} times on the replicas of stage {s}; each must run it equally often")
    rs = sorted(seqs)
    for x in rs:
        for y in rs:
            if x < y:
                shared = set(seqs[x]) & set(seqs[y])
                a, b = [s for s in seqs[x] if s in shared], [s for s in seqs[y] if s in shared]
                if a != b:
                    out.append(f"ranks {x} and {y} run their shared SYNCs in different orders ({a} vs {b}): "
                               f"the all-reduces would wait on each other")
    for r, seq in schedule.actions.items():
        for j, a in enumerate(seq):
            if a.kind == _K.STEP and len(schedule.stage_to_rank.get(a.stage, ())) > 1 and a.version is None:
                if not any(b.kind == _K.SYNC and b.stage == a.stage for b in seq[:j]):
                    out.append(f"rank {r} step {j}: STEP{a.stage} of replicated stage {a.stage} comes before any "
                               f"SYNC{a.stage}: its replicas would step with different gradients")
    return out


def _versions(schedule: Schedule, pos) -> list[str]:
    out = []
    for s in range(schedule.n_stages):
        vers = [a.version for seq in schedule.actions.values() for a in seq
                if a.stage == s and a.kind in COMPUTE]
        if any(v is None for v in vers) and any(v is not None for v in vers):
            out.append(f"stage {s}: some F/B/W carry a weight version and some do not; label all or none")
    for r, seq in schedule.actions.items():
        fver = {(a.stage, a.microbatch): a.version for a in seq if a.kind == _K.F}
        steps: dict[int, int] = defaultdict(int)
        for j, a in enumerate(seq):
            if a.kind in (_K.B, _K.W) and (a.stage, a.microbatch) in fver and a.version != fver[(a.stage, a.microbatch)]:
                out.append(f"rank {r} step {j}: {a.short()} uses version {a.version} but its forward used "
                           f"{fver[(a.stage, a.microbatch)]} (weight stashing: a backward uses its forward's weights)")
            if a.kind == _K.STEP:
                steps[a.stage] += 1
                if a.version is not None and a.version != steps[a.stage]:
                    out.append(f"rank {r} step {j}: {a.short()} is STEP number {steps[a.stage]} of stage {a.stage}, "
                               f"so it creates version {steps[a.stage]}, not {a.version}")
                if a.version is None:
                    late = [b.short() for b in seq[j + 1:] if b.kind in (_K.B, _K.W) and b.stage == a.stage]
                    if late:
                        out.append(f"rank {r} step {j}: STEP{a.stage} comes before {late[:3]}: a synchronous step "
                                   f"must follow every backward of its stage")
        for s in schedule.rank_stages(r):
            unversioned = [a for a in seq if a.kind == _K.STEP and a.stage == s and a.version is None]
            if len(unversioned) > 1:
                out.append(f"rank {r}: stage {s} has {len(unversioned)} unversioned STEPs; a synchronous schedule "
                           f"steps each stage once")
    return out
