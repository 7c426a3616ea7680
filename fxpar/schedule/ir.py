"""The pipeline schedule IR: one ``Action`` per thing a rank does, a ``Schedule`` of per-rank lists.

Text grammar of one action (``str(action)`` prints it, :func:`parse_action` reads it back)::

    action   := [RANK ":"] body
    body     := ("F" | "B" | "I" | "W") STAGE "." MB [ "@" VERSION ]  compute (versioned)
              | "FULL" STAGE "." MB                                   fused F+B+REDUCE_GRAD+STEP
              | ("SF" | "SB") STAGE "." MB ">" PEER                  send (activations | gradients)
              | ("RF" | "RB") STAGE "." MB "<" PEER                  receive (activations | gradients)
              | ("RG" | "UNSHARD" | "RESHARD") STAGE                  whole-stage, no microbatch
              | "STEP" STAGE [ "@" VERSION ]                          optimizer step of a stage

    F0.3      forward of stage 0, microbatch 3 (F of the last stage also computes the loss)
    B1.2@4    backward of stage 1, microbatch 2 (input and weight gradients), with weight version 4
    I1.2      input-gradient half of that backward (zero bubble): makes what SB1.2 sends
    W1.2      weight-gradient half; comes after I1.2 on the same rank
    FULL0.0   forward, backward, REDUCE_GRAD and STEP of stage 0 for microbatch 0 as one graph
              (the one-stage, one-microbatch program: plain data parallelism)
    SF0.3>1   send the output activations of stage 0, microbatch 3, to rank 1
    RF1.3<0   receive the input activations of stage 1, microbatch 3, from rank 0
    SB1.2>0   send the input gradients of stage 1, microbatch 2, to rank 0
    RB0.2<1   receive the output gradients of stage 0, microbatch 2, from rank 1
    RG0       REDUCE_GRAD: stage 0's gradient collectives over every rank holding stage 0 (its
              replicas: dp, Chimera's two pipelines, tied weights)
    UNSHARD0  gather stage 0's sharded parameters (ZeRO-3; reserved)
    RESHARD0  free stage 0's gathered parameters again (ZeRO-3; reserved)
    STEP0@3   optimizer step of stage 0 that creates weight version 3 of stage 0
    2:F0.3    the same forward, on rank 2 (the full form; inside a rank's list the prefix is left out)

Per (stage, microbatch) the backward is either one ``B``, or one ``I`` followed later by one ``W``
on the same rank (``validate`` refuses mixtures); a one-stage program may instead run ``FULL``.

A send names the stage that produced the tensor, a receive the stage that consumes it: ``SF0.3>1``
on rank 0 matches ``RF1.3<0`` on rank 1, and ``SB1.2>0`` on rank 1 matches ``RB0.2<1`` on rank 0.

Versions (asynchronous schedules only; ``None`` in synchronous ones, printed as nothing): version
``v`` of a stage is its weights after ``v`` optimizer steps of that stage, version 0 the initial
weights. ``F``/``B``/``I``/``W`` carry the version they compute with; a backward uses the version
its ``F`` used (PipeDream's weight stashing, Harlap/Narayanan et al. SOSP'19). ``STEP@v`` creates
version v; ``FULL`` carries no version but, like a STEP, creates the next one.

A :class:`Schedule` prints as a step x rank grid (like ``_format_pipeline_order`` in
``torch.distributed.pipelining``) under a one-line header, and :meth:`Schedule.parse` reads that grid,
or the plainer ``rank R: A A A`` lines of :meth:`Schedule.format_lists`, back::

    # schedule name=single ranks=1 stages=1 microbatches=2 placement=0:0
    rank 0: F0.0 B0.0 F0.1 B0.1 RG0 STEP0
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from fxpar.schedule.exceptions import ScheduleParseError

__all__ = ["ActionKind", "Action", "Schedule", "parse_action", "COMPUTE", "BACKWARD", "SENDS", "RECVS",
           "WHOLE_STAGE"]


class ActionKind(str, Enum):
    F = "F"            # forward of one stage, one microbatch
    B = "B"            # whole backward: input and weight gradients
    I = "I"            # noqa: E741 - input-gradient half of a backward (zero-bubble split); a W follows
    W = "W"            # weight-gradient half of a backward, after its I
    FULL = "FULL"      # forward + backward + REDUCE_GRAD + STEP of a one-stage program, one graph
    SEND_F = "SF"      # send output activations to the rank running the next stage
    RECV_F = "RF"      # receive input activations from the rank running the previous stage
    SEND_B = "SB"      # send input gradients to the rank running the previous stage
    RECV_B = "RB"      # receive output gradients from the rank running the next stage
    REDUCE_GRAD = "RG"  # a stage's gradient collectives over every rank holding it
    UNSHARD = "UNSHARD"  # ZeRO-3: gather a stage's parameters (reserved)
    RESHARD = "RESHARD"  # ZeRO-3: free them again (reserved)
    STEP = "STEP"      # optimizer step of a stage


COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.FULL})
BACKWARD = frozenset({ActionKind.B, ActionKind.I, ActionKind.W})
SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
WHOLE_STAGE = frozenset({ActionKind.REDUCE_GRAD, ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.STEP})
_VERSIONED = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.STEP})
_NO_MB = WHOLE_STAGE

_ACTION_RE = re.compile(r"^(?:(\d+):)?(UNSHARD|RESHARD|FULL|STEP|RG|SF|SB|RF|RB|F|B|I|W)(\d+)(?:\.(\d+))?"
                        r"(?:([<>])(\d+))?(?:@(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One thing one rank does. See the module docstring for the text form."""

    rank: int
    kind: ActionKind
    stage: int
    microbatch: int | None = None
    peer: int | None = None
    version: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "kind", ActionKind(self.kind))
        k = self.kind
        if k in _NO_MB and self.microbatch is not None:
            raise ValueError(f"{k.name} applies to a whole stage; it takes no microbatch (got {self.microbatch})")
        if k not in _NO_MB and self.microbatch is None:
            raise ValueError(f"{k.name} of stage {self.stage} needs a microbatch")
        if (k in SENDS or k in RECVS) != (self.peer is not None):
            raise ValueError(f"{k.name}: a peer rank is required for SEND/RECV and only for them")
        if self.version is not None and k not in _VERSIONED:
            raise ValueError(f"{k.name} carries no weight version (only F, B, I, W and STEP do)")
        if min(self.rank, self.stage, self.microbatch or 0, self.peer or 0, self.version or 0) < 0:
            raise ValueError(f"negative rank, stage, microbatch, peer or version in {self!r}")

    def short(self) -> str:
        """The text form without the rank prefix, as it appears in a rank's list: ``F0.3``."""
        s = f"{self.kind.value}{self.stage}"
        if self.microbatch is not None:
            s += f".{self.microbatch}"
        if self.kind in SENDS:
            s += f">{self.peer}"
        elif self.kind in RECVS:
            s += f"<{self.peer}"
        if self.version is not None:
            s += f"@{self.version}"
        return s

    def __str__(self) -> str:
        return f"{self.rank}:{self.short()}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


def parse_action(text: str, rank: int | None = None) -> Action:
    """Read one action. ``"1:F0.3"`` carries its rank; ``"F0.3"`` takes it from ``rank``."""
    m = _ACTION_RE.match(text.strip())
    if m is None:
        raise ScheduleParseError(f"cannot read action {text!r}: expected e.g. F0.3, B1.2@4, I1.2, W1.2, FULL0.0, "
                                 f"SF0.3>1, RF1.3<0, RG0, UNSHARD0, RESHARD0, STEP0@1, optionally prefixed by "
                                 f"'RANK:'")
    r, kind, stage, mb, arrow, peer, ver = m.groups()
    if r is None and rank is None:
        raise ScheduleParseError(f"action {text!r} names no rank: write '{rank or 0}:{text}' or pass rank=")
    if r is not None and rank is not None and int(r) != rank:
        raise ScheduleParseError(f"action {text!r} says rank {r} but sits in rank {rank}'s list")
    k = ActionKind(kind)
    want_arrow = ">" if k in SENDS else "<" if k in RECVS else None
    if arrow != want_arrow:
        raise ScheduleParseError(f"action {text!r}: {k.name} takes {repr(want_arrow) if want_arrow else 'no'} peer arrow")
    try:
        return Action(int(r) if r is not None else rank, k, int(stage), None if mb is None else int(mb),
                      None if peer is None else int(peer), None if ver is None else int(ver))
    except ValueError as e:
        raise ScheduleParseError(f"action {text!r}: {e}") from None


def _format_placement(stage_to_rank: dict[int, tuple[int, ...]]) -> str:
    return ",".join(f"{s}:{'/'.join(map(str, rs))}" for s, rs in sorted(stage_to_rank.items()))


_HEADER_FIELDS = ("name", "ranks", "stages", "microbatches", "placement")


def _parse_header(line: str) -> dict:
    """The ``key=value`` fields of a ``# schedule ...`` header; raises naming what is missing or malformed."""
    example = "e.g. '# schedule name=mine ranks=2 stages=2 microbatches=4 placement=0:0,1:1' (Schedule.header() writes one)"
    tokens = line[len("# schedule "):].split()
    bad = [t for t in tokens if "=" not in t]
    if bad:
        raise ScheduleParseError(f"schedule header {line!r}: {bad[0]!r} is not a key=value field; write every field as "
                                 f"key=value, {example}")
    fields = dict(t.split("=", 1) for t in tokens)
    missing = [k for k in _HEADER_FIELDS if k not in fields]
    if missing:
        raise ScheduleParseError(f"schedule header {line!r} has no {', '.join(m + '=' for m in missing)}: a header names "
                                 f"{', '.join(k + '=' for k in _HEADER_FIELDS)}; add {missing[0]}=..., {example}")
    return fields


def _parse_placement(text: str) -> dict[int, tuple[int, ...]]:
    out = {}
    for item in text.split(","):
        s, rs = item.split(":")
        out[int(s)] = tuple(int(r) for r in rs.split("/"))
    return out


@dataclass
class Schedule:
    """Per-rank action lists plus the shape of the pipeline.

    ``stage_to_rank[s]`` is the tuple of ranks holding a replica of stage ``s``: ``(s,)`` for
    1F1B, ``(s % p,)`` for interleaved, ``(s, p-1-s)`` for Chimera. Every rank in ``actions`` is
    listed, even one with nothing to do.
    """

    actions: dict[int, list[Action]]
    n_stages: int
    n_microbatches: int
    stage_to_rank: dict[int, tuple[int, ...]]
    name: str = "custom"
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    def rank_stages(self, rank: int) -> list[int]:
        """The stages whose weights ``rank`` holds."""
        return [s for s, rs in sorted(self.stage_to_rank.items()) if rank in rs]

    def where(self, kind: ActionKind, stage: int, microbatch: int | None = None) -> list[Action]:
        """Every action of this kind, stage and microbatch, over all ranks (for tests and tools)."""
        return [a for acts in self.actions.values() for a in acts
                if a.kind == kind and a.stage == stage and (microbatch is None or a.microbatch == microbatch)]

    # ----- text -----------------------------------------------------------------------------
    def header(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in sorted(self.meta.items()))
        return (f"# schedule name={self.name} ranks={self.n_ranks} stages={self.n_stages} "
                f"microbatches={self.n_microbatches} placement={_format_placement(self.stage_to_rank)}{extra}")

    def format_lists(self) -> str:
        """Header, then one ``rank R: A A A`` line per rank."""
        lines = [self.header()]
        for r in sorted(self.actions):
            lines.append(f"rank {r}: " + " ".join(a.short() for a in self.actions[r]))
        return "\n".join(lines)

    def __str__(self) -> str:
        """Header, then a grid: one row per step (position in the rank's list), one column per rank."""
        ranks = sorted(self.actions)
        cols = {r: [a.short() for a in self.actions[r]] for r in ranks}
        width = max([len(x) for c in cols.values() for x in c] + [len(f"rank{r}") for r in ranks] + [1])
        n_steps = max((len(c) for c in cols.values()), default=0)
        sw = max(len(str(max(n_steps - 1, 0))), 4)
        lines = [self.header(), "step".rjust(sw) + "  " + "  ".join(f"rank{r}".ljust(width) for r in ranks).rstrip()]
        for t in range(n_steps):
            cells = [(cols[r][t] if t < len(cols[r]) else ".").ljust(width) for r in ranks]
            lines.append(str(t).rjust(sw) + "  " + "  ".join(cells).rstrip())
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        """Read :meth:`__str__`'s grid or :meth:`format_lists`'s lines back into a Schedule."""
        lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines or not lines[0].startswith("# schedule "):
            raise ScheduleParseError("schedule text must start with a '# schedule name=... ranks=... stages=... "
                                     "microbatches=... placement=...' header line")
        fields = _parse_header(lines[0])
        try:
            n_ranks, n_stages, n_mb = int(fields.pop("ranks")), int(fields.pop("stages")), int(fields.pop("microbatches"))
        except ValueError as e:
            raise ScheduleParseError(f"schedule header {lines[0]!r}: ranks, stages and microbatches must be integers "
                                     f"({e}); e.g. '# schedule name=mine ranks=2 stages=2 microbatches=4 "
                                     "placement=0:0,1:1'") from None
        try:
            placement, name = _parse_placement(fields.pop("placement")), fields.pop("name")
        except ValueError:
            raise ScheduleParseError(f"schedule header {lines[0]!r}: placement= lists stage:ranks pairs separated by "
                                     "commas, ranks of one stage by '/', e.g. placement=0:0,1:1 or placement=0:0/1") \
                from None
        actions: dict[int, list[Action]] = {r: [] for r in range(n_ranks)}
        body = lines[1:]
        if body and body[0].split()[0] == "step":
            ranks = [int(c[len("rank"):]) for c in body[0].split()[1:]]
            for ln in body[1:]:
                cells = ln.split()[1:]
                for r, cell in zip(ranks, cells):
                    if cell != ".":
                        actions[r].append(parse_action(cell, r))
        else:
            for ln in body:
                m = re.match(r"^rank (\d+):(.*)$", ln)
                if m is None:
                    raise ScheduleParseError(f"cannot read line {ln!r}: expected 'rank R: ACTION ACTION ...'")
                r = int(m.group(1))
                actions[r] = [parse_action(tok, r) for tok in m.group(2).split()]
        return cls(actions, n_stages, n_mb, placement, name, fields)
