"""Structural checks of a Schedule, before any simulation: coverage, pairing, placement, versions.

``validate(schedule)`` raises :class:`ScheduleValidationError` listing every broken rule;
``find_problems(schedule)`` returns the same list of plain-language problems. The rules:

1. Every (stage, microbatch) has exactly one F and one backward, on one rank that holds the stage
   (``stage_to_rank``), F first. The backward is either one B, or one I and one W with F < I < W
   (never a mixture such as B and W, or I without W). Or, in a one-stage schedule, one FULL
   instead of all of these.
2. Every F of stage s > 0 has its input on its rank before it (F of s-1 earlier there, or an RF);
   every B or I of a non-last stage likewise has its output gradient (B or I of s+1 earlier there, or
   an RB).
3. Every SEND has exactly one matching RECV at its peer and vice versa, and on each channel
   (src, dst, activations|gradients) the sends and the receives come in the same order -- the order
   in which a runtime with ordered point-to-point messages (NCCL, gloo with one tag) pairs them.
   A SEND comes after the compute that makes its tensor, on the same rank (SB: its B or I).
4. RG s (REDUCE_GRAD), UNSHARD s, RESHARD s and STEP s only on ranks holding s. RG s equally often on
   every holder of s, and every pair of ranks meets their shared RGs in the same order. A STEP of a
   replicated stage has an RG of that stage since its previous STEP; in a synchronous schedule no
   backward of s falls between the RG s and the STEP s it precedes.
5. Versions: either every F/B/I/W of a stage has ``@v`` or none does; a backward uses its F's
   version; ``STEP s@v`` on a rank numbers 1, 2, 3, ... . Without versions (synchronous): each rank
   STEPs each stage it holds once (a FULL counts as its STEP), after all that stage's backwards there.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from fxpar.schedule.exceptions import ScheduleValidationError
from fxpar.schedule.ir import BACKWARD, COMPUTE, RECVS, SENDS, WHOLE_STAGE, ActionKind, Schedule

__all__ = ["validate", "find_problems"]

_K = ActionKind
_VERSIONED_COMPUTE = (_K.F, _K.B, _K.I, _K.W)


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
            elif a.kind in COMPUTE or a.kind in WHOLE_STAGE:
                if r not in schedule.stage_to_rank.get(a.stage, ()):
                    out.append(f"rank {r} step {j}: {a.short()} runs stage {a.stage}, which lives on ranks "
                               f"{schedule.stage_to_rank.get(a.stage, ())}, not rank {r}")
            if a.kind in COMPUTE:
                pos[(a.kind, a.stage, a.microbatch)].append((r, j))
    out += _coverage(schedule, pos)
    out += _data_deps(schedule)
    out += _pairs(schedule)
    out += _collectives(schedule)
    out += _versions(schedule)
    return out


def _coverage(schedule: Schedule, pos) -> list[str]:
    out = []
    for s in range(schedule.n_stages):
        for i in range(schedule.n_microbatches):
            found = {k: pos.get((k, s, i), []) for k in (_K.F, _K.B, _K.I, _K.W, _K.FULL)}
            out += _one_microbatch(schedule, s, i, found)
    return out


def _one_microbatch(schedule: Schedule, s: int, i: int, found: dict) -> list[str]:
    name = f"stage {s} microbatch {i}"
    f, b, i_, w, full = (found[k] for k in (_K.F, _K.B, _K.I, _K.W, _K.FULL))
    for kind, at in found.items():
        if len(at) > 1:
            return [f"{kind.value}{s}.{i} appears {len(at)} times (at {at}); it must appear at most once"]
    if full:
        if f or b or i_ or w:
            extra = " ".join(f"{k.value}{s}.{i}" for k in (_K.F, _K.B, _K.I, _K.W) if found[k])
            return [f"{name}: FULL{s}.{i} already runs its forward and backward; remove {extra}, or replace "
                    f"FULL{s}.{i} by F{s}.{i} B{s}.{i} (+ RG{s} STEP{s})"]
        if schedule.n_stages != 1:
            return [f"{name}: FULL{s}.{i} is a whole one-stage training step, but this schedule has "
                    f"{schedule.n_stages} stages; use F{s}.{i} and B{s}.{i} (or I/W) in a pipeline"]
        return []
    if not f:
        return [f"F{s}.{i} appears 0 times; it must appear exactly once (or FULL{s}.{i} in a one-stage schedule)"]
    if b and (i_ or w):
        return [f"{name} mixes B{s}.{i} with {'I' if i_ else 'W'}{s}.{i} (at {b + i_ + w}): a backward is either "
                f"one B, or an I followed later by a W; keep B{s}.{i} alone or replace it by I{s}.{i} ... W{s}.{i}"]
    if not b and not i_:
        return [f"B{s}.{i} appears 0 times; {name} needs a backward: B{s}.{i}, or I{s}.{i} then W{s}.{i}"]
    if i_ and not w:
        return [f"{name} has I{s}.{i} but no W{s}.{i}: its weight gradients would never be computed; "
                f"add W{s}.{i} after I{s}.{i} on rank {i_[0][0]}"]
    steps = [("F", f[0])] + ([("B", b[0])] if b else [("I", i_[0]), ("W", w[0])])
    out = []
    ranks = {r for _, (r, _) in steps}
    if len(ranks) > 1:
        where = ", ".join(f"{k}{s}.{i} on rank {r}" for k, (r, _) in steps)
        return [f"{name} runs on several ranks ({where}): a backward needs its own forward's activations, "
                f"so all must be on one rank"]
    for (k1, (_, j1)), (k2, (r, j2)) in zip(steps, steps[1:]):
        if j2 < j1:
            out.append(f"{k2}{s}.{i} (rank {r} step {j2}) comes before its {k1}{s}.{i} (step {j1})")
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
            if a.kind in (_K.B, _K.I) and s < n - 1 and ("grad", s, i) not in have:
                out.append(f"rank {r} step {j}: {a.short()} has no output gradient: neither B{s + 1}.{i} (or "
                           f"I{s + 1}.{i}) nor RB{s}.{i}<SRC comes before it on rank {r}")
            if a.kind == _K.SEND_F and ("F", s, i) not in have:
                out.append(f"rank {r} step {j}: {a.short()} sends a tensor that F{s}.{i} has not made yet on rank {r}")
            if a.kind == _K.SEND_B and ("dx", s, i) not in have:
                out.append(f"rank {r} step {j}: {a.short()} sends a tensor that B{s}.{i} (or I{s}.{i}) has not made "
                           f"yet on rank {r}")
            if a.kind in COMPUTE:
                have.add((a.kind.value, s, i))
            if a.kind == _K.F or a.kind == _K.RECV_F:
                have.add(("in", s + 1 if a.kind == _K.F else s, i))
            if a.kind in (_K.B, _K.I):
                have |= {("dx", s, i), ("grad", s - 1, i)}
            if a.kind == _K.RECV_B:
                have.add(("grad", s, i))
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
    seqs = {r: [a.stage for a in seq if a.kind == _K.REDUCE_GRAD] for r, seq in schedule.actions.items()}
    for s, ranks in schedule.stage_to_rank.items():
        counts = {r: seqs.get(r, []).count(s) for r in ranks}
        if len(set(counts.values())) > 1:
            out.append(f"RG{s} appears {counts} times on the ranks holding stage {s}; each must run it equally "
                       f"often (it is a collective over all of them)")
    rs = sorted(seqs)
    for x in rs:
        for y in rs:
            if x < y:
                shared = set(seqs[x]) & set(seqs[y])
                a, b = [s for s in seqs[x] if s in shared], [s for s in seqs[y] if s in shared]
                if a != b:
                    out.append(f"ranks {x} and {y} run their shared RGs in different orders ({a} vs {b}): "
                               f"the collectives would wait on each other; put them in increasing stage order")
    for r, seq in schedule.actions.items():
        reduced_at: dict[int, int] = {}             # stage -> step of its latest RG since its last STEP
        for j, a in enumerate(seq):
            if a.kind == _K.REDUCE_GRAD:
                reduced_at[a.stage] = j
            elif a.kind == _K.STEP:
                s = a.stage
                if s not in reduced_at and len(schedule.stage_to_rank.get(s, ())) > 1:
                    out.append(f"rank {r} step {j}: STEP{s} of replicated stage {s} has no RG{s} before it: its "
                               f"replicas would step with different gradients; add RG{s} before it "
                               f"(fxpar.schedule.ensure_reduce_grad does)")
                if s in reduced_at and a.version is None:
                    late = [b.short() for b in seq[reduced_at[s] + 1:j] if b.kind in BACKWARD and b.stage == s]
                    if late:
                        out.append(f"rank {r} step {j}: {late[:3]} come after RG{s} (step {reduced_at[s]}) but before "
                                   f"STEP{s}: their gradients would miss the reduction; move RG{s} after them")
                reduced_at.pop(s, None)
    return out


def _versions(schedule: Schedule) -> list[str]:
    out = []
    for s in range(schedule.n_stages):
        vers = [a.version for seq in schedule.actions.values() for a in seq
                if a.stage == s and a.kind in _VERSIONED_COMPUTE]
        if any(v is None for v in vers) and any(v is not None for v in vers):
            out.append(f"stage {s}: some F/B/I/W carry a weight version and some do not; label all or none")
    for r, seq in schedule.actions.items():
        fver = {(a.stage, a.microbatch): a.version for a in seq if a.kind == _K.F}
        steps: dict[int, int] = defaultdict(int)
        for j, a in enumerate(seq):
            mb = (a.stage, a.microbatch)
            if a.kind in BACKWARD and mb in fver and a.version != fver[mb]:
                out.append(f"rank {r} step {j}: {a.short()} uses version {a.version} but its forward used "
                           f"{fver[mb]} (weight stashing: a backward uses its forward's weights)")
            if a.kind in (_K.STEP, _K.FULL):
                steps[a.stage] += 1
                if a.version is not None and a.version != steps[a.stage]:
                    out.append(f"rank {r} step {j}: {a.short()} is STEP number {steps[a.stage]} of stage {a.stage}, "
                               f"so it creates version {steps[a.stage]}, not {a.version}")
                if a.version is None:
                    late = [b.short() for b in seq[j + 1:] if b.kind in BACKWARD and b.stage == a.stage]
                    if late:
                        out.append(f"rank {r} step {j}: {a.short()} comes before {late[:3]}: a synchronous step "
                                   f"must follow every backward of its stage")
        for s in schedule.rank_stages(r):
            unversioned = [a for a in seq if a.kind in (_K.STEP, _K.FULL) and a.stage == s and a.version is None]
            if len(unversioned) > 1:
                out.append(f"rank {r}: stage {s} has {len(unversioned)} unversioned STEPs (a FULL counts as one); "
                           f"a synchronous schedule steps each stage once")
    return out
