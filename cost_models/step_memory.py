"""A rank's peak memory over one step: the graphs it runs in order, and what the executor holds between them.

:func:`cost_models.memory.liveness` gives each graph's own live bytes. Between graphs the runtime
(``fxpar/runtime/executor.py``) holds tensors no graph owns, and this walk follows them::

    F0.0 ─saved──────────────▶ B0.0 ─grads─▶ accumulator ───────────────────────────▶ end of step
         F0.1 ─saved─────────────────▶ B0.1 ─grads─▶ (summed into the accumulator, then freed)
                                                RG0 ─pending─▶ STEP0 ─grads (views)─▶ end of step

* **state**: param / buffer / opt_state placeholders, once per ``fxpar_param`` key for the rank; and the
  rank's microbatches (``input`` / ``target`` placeholders, one per graph run that reads them), which the rank
  holds for the whole step;
* **values** a graph returns live on after it:

  - an output the item's ``keep`` names: until that later item (a label) or the end (``"end"``) -- F's saved
    activations until their microbatch's last backward;
  - a parameter gradient (``fxpar_grad_of`` on the output node): the first one per key and graph is the
    executor's accumulator (``_Window.acc``) or its reduced copy (``synced``), kept to the end of the step;
    a later microbatch's is added into it and freed (the first such sum makes a new tensor while the old one
    is alive: one accumulator storage more, at the graph's end);
  - any other output a later graph reads (the same fake storage as one of its placeholders): until that
    reader (the oldest waiting value first); ZeRO-3's gathered parameters (read as ``unsharded``) from UNSHARD
    to RESHARD, after the stage's last backward;
  - an output no later graph reads and a message follows: kept to the end (the executor holds each sent
    tensor until it waits on the send); otherwise freed with its graph. A ``keep`` label naming an item that is
    not a graph frees the value at that item: ``fxpar.program`` names the RECV after which the runtime waits on
    the send (:func:`fxpar.schedule.sends.send_releases`), or ``"end"``;
  - an output that is a view of a held value (STEP's reduced gradients, views of RG's buffer) extends it.

* an **asynchronous update** (a versioned ``STEPs@u``): its new weights and state replace the persistent ones (held
  once, in the state), the gradient accumulators it read are freed, and the weights it replaced (version u-1) stay
  while a later F or B of the window names that version, until the stage's first update after that last use (the
  runtime's ``VersionStore``: PipeDream's stash of p-s versions, 2BW's two, one for the schedules that read the
  newest weights);
* a graph's **own** bytes are its liveness peak less every placeholder that is state, a microbatch or a held
  value (one storage, counted once, however many views of it the graph takes).

``peak = state + max over graphs i of (held values while i runs + own_i)``. A held value whose freeing item
takes none of its storage as an input counts inside that item's own inputs instead (graphs without fake
values: the item is taken to read it). What it leaves out: the allocator's caching and fragmentation, a
received message before the graph that reads it, scratch inside one kernel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fxpar import meta as M
from fxpar.roles import Role

__all__ = ["sequence_peak", "sequence_timeline"]

_PERSISTENT = ("param", "buffer", "opt_state")          # categories
_BATCH = (Role.INPUT, Role.TARGET)
_CATEGORIES = ("param", "buffer", "opt_state", "input", "activation", "grad", "new_state", "temporary")
# a versioned action's label (``fxpar.schedule``'s text form): kind, stage, microbatch, weight version
_VERSIONED = re.compile(r"^(STEP|F|B|I|W)(\d+)(?:\.(\d+))?@(\d+)$")


@dataclass
class _Value:
    """A tensor the executor holds between graphs: its bytes, fake storage, category and the item it goes after
    (``None``: when a later graph first reads it)."""
    nbytes: float
    keys: set
    category: str
    until: int | None
    src: int = 0                      # id of the Liveness that made it: another run of that graph never reads it
    keep_label: bool = False          # freed by a ``keep`` label


def _check_keep(j, label, keep, lv) -> dict:
    per_out = keep if isinstance(keep, dict) else {}
    for idx in per_out:
        if not isinstance(idx, int) or not 0 <= idx < len(lv.outputs):
            raise ValueError(f"keep on item {j} ({label or 'unlabelled'}) names output {idx!r}; the graph "
                             f"has {len(lv.outputs)} outputs (flat, numbered from 0)")
    return per_out


class _Walk:
    """The state of the walk over one rank's sequence (see the module docstring)."""

    def __init__(self, runs):
        self.runs, self.n = runs, len(runs)
        self.labels = [r[1] for r in runs]
        self.persistent: dict = {}
        self.state_keys: set = set()
        self.batch = 0.0
        self.readers: dict = {}               # fake storage key -> [(item index, placeholder role)]
        self.backward: set = set()            # items that read saved values (B, I, W)
        for i, (lv, *_) in enumerate(runs):
            if lv is None:
                continue
            for st in _placeholders(lv):
                if st.category in _PERSISTENT:
                    key = (st.category, st.producer.meta.get(M.PARAM.name) or (id(lv), st.producer.name))
                    self.persistent[key] = (st.category, st.nbytes)
                elif st.role in _BATCH:
                    self.batch += st.nbytes
                else:
                    if st.key is not None:
                        self.readers.setdefault(st.key, []).append((i, st.role))
                    if st.role == Role.SAVED:
                        self.backward.add(i)
                    continue
                self.state_keys |= st.keys
        self.base = sum(b for _, b in self.persistent.values()) + self.batch
        self.values: list = []
        self.accumulated: dict = {}           # (graph, gradient key) -> the value that holds its sum
        self.owned: set = set()
        self.bound: set = set()               # ids of the held values the current graph reads
        self.versions = _Versions(self.labels)

    def is_update(self, i) -> bool:
        """Item i is an asynchronous update (``STEPs@v``): it steps its stage inside the window."""
        return self.versions.steps.get(i) is not None

    def until(self, j, spec) -> int:
        if spec == "end":
            return self.n
        u = next((u for u in range(j + 1, self.n) if self.labels[u] == spec), None)
        if u is None:
            raise ValueError(f"keep={spec!r} on item {j} ({self.labels[j] or 'unlabelled'}) names no later item of "
                             f"its sequence; give the label of the item that last reads those outputs, or 'end'")
        return u

    def own(self, i, lv) -> tuple:
        """(graph i's own peak bytes, its own bytes at its end): its liveness with what the walk holds elsewhere
        taken out of its inputs (``self.outside``: those bytes); binds the values it reads."""
        outside, bound = 0.0, set()
        for st in _placeholders(lv):
            if st.category in _PERSISTENT or st.role in _BATCH or st.keys & self.state_keys:
                outside += st.nbytes
                continue
            v = self._bind(i, lv, st.key)
            if v is not None:
                outside += st.nbytes
                bound.add(id(v))
        for v in self.values:                 # graphs not linked by fake storages (none bound): a value freed here by
            if v.keep_label and v.until == i and not bound:     # a label is taken to be one of the graph's inputs
                v.until = -1
        self.outside, self.bound = outside, bound
        return lv.peak_bytes - outside, (lv.live[-1] if lv.live else 0.0) - outside

    def _bind(self, i, lv, key):
        """The held value a placeholder of graph i is: one freed at i, else the oldest waiting for a reader."""
        if key is None:
            return None
        mine = [v for v in self.values if key in v.keys and (v.until is None or v.until >= 0) and v.src != id(lv)]
        v = next((v for v in mine if v.until == i), None) or next((v for v in mine if v.until is None), None) \
            or (mine[0] if mine else None)
        if v is not None and v.until is None:
            v.until = i
        return v

    def _gathered_until(self, i, lv):
        """ZeRO-3 under a schedule: UNSHARD's parameters live together until RESHARD, which follows the stage's last
        backward (the last graph that reads ``saved`` values: B, or W, which reads no weight); None if no later
        graph reads them as ``unsharded``."""
        last = [r for parts in lv.out_parts for st in parts for k in st.keys
                for r, role in self.readers.get(k, ()) if r > i and role == Role.UNSHARDED]
        return max(last + [r for r in self.backward if r > i]) if last else None

    def held(self) -> dict:
        """category -> bytes of the values held while the current graph runs."""
        out: dict = {}
        for v in self.values:
            if v.until is None or v.until >= 0:
                out[v.category] = out.get(v.category, 0.0) + v.nbytes
        return out

    def after(self, i, lv, keep) -> float:
        """Graph i has run: drop what it freed, start its outputs. Returns the transient of a first sum into an
        accumulator (counted at the graph's end)."""
        per_out = _check_keep(i, self.labels[i], keep, lv)
        extra, seen, made = 0.0, set(), {}
        update = self.is_update(i)
        if update:
            self._update(i, lv)
        gathered = self._gathered_until(i, lv)
        for idx, st in ((idx, st) for idx, parts in enumerate(lv.out_parts) for st in parts):
            spec = per_out.get(idx) if isinstance(keep, dict) else keep
            if id(st) in seen:                # one storage under two outputs: held until the later of their ends
                v = made.get(id(st))
                if v is not None and spec is not None:
                    v.until = max(v.until, self.until(i, spec))
                continue
            seen.add(id(st))
            grad = lv.out_grad_of[idx] if idx < len(lv.out_grad_of) else None
            if grad is not None and spec is None:
                extra = max(extra, self._accumulate(i, lv, grad, st))
            elif st.producer.op == "placeholder" and (self._extend(lv, st.keys, self.until(i, spec) if spec is not None
                                                                  else None) or st.keys & self.state_keys
                                                     or st.role in _BATCH or st.category in _PERSISTENT):
                continue                    # the graph hands on what it was given: held already
            elif update and st.category == "new_state":
                continue                    # the stage's new weights and state replace the persistent ones
            elif spec is not None:
                made[id(st)] = _Value(st.nbytes, st.keys, _category(st), self.until(i, spec), id(lv),
                                      keep_label=spec != "end")
                self.values.append(made[id(st)])
            elif self._read_later(i, st.keys):
                self.values.append(_Value(st.nbytes, st.keys, "param" if gathered else _category(st), gathered, id(lv)))
            elif self._message_follows(i):
                self.values.append(_Value(st.nbytes, st.keys, _category(st), self.n, id(lv)))
        self.values = [v for v in self.values if v.until is None or v.until > i]
        return extra

    def _update(self, i, lv) -> None:
        """An asynchronous update (``STEPs@u``, ``fxpar/runtime``'s ``VersionStore``): the gradient accumulators it
        read are freed after it (the next microbatch's backward starts fresh ones); the stage's weights before it
        (version u-1) stay, as a stashed version, while a later F or B names that version, until the first update
        of the stage after that last use."""
        for key in [k for k, v in self.accumulated.items() if id(v) in self.bound]:
            acc = self.accumulated.pop(key)
            acc.until = i
            self.owned.discard(id(acc))
        until = self.versions.stashed_until(i)
        if until is not None:
            nbytes = sum(st.nbytes for st in _placeholders(lv) if st.category == "param")
            self.values.append(_Value(nbytes, set(), "param", until, id(lv)))

    def _accumulate(self, i, lv, grad, st) -> float:
        """A parameter gradient: the first per graph and key stays to the end (the executor's accumulator, or its
        reduced copy); a later microbatch's is added into it and freed, the first such sum making a new tensor
        while the old one lives (returned: counted at the graph's end)."""
        acc = self.accumulated.get((id(lv), grad))
        if acc is None:
            if st.producer.op == "placeholder":      # a value an earlier graph made (I's gradients that W returns)
                mine = [v for v in self.values if v.keys & st.keys and v.until is not None and v.until >= 0
                        and v.src != id(lv)]
                acc = next((v for v in mine if v.until == i), mine[0] if mine else None)
                if acc is None:
                    return 0.0
                acc.until, acc.category = self.n, "grad"
            else:
                acc = _Value(st.nbytes, st.keys, "grad", self.n, id(lv))
                self.values.append(acc)
            self.accumulated[(id(lv), grad)] = acc
            return 0.0
        if id(acc) in self.owned:
            return 0.0
        self.owned.add(id(acc))
        return acc.nbytes

    def _extend(self, lv, keys, until) -> bool:
        """Hold the values graph ``lv`` was given with one of ``keys`` at least until ``until``; False if none."""
        mine = [v for v in self.values if v.keys & keys and v.until is not None and v.until >= 0 and v.src != id(lv)]
        for v in mine:
            v.until = max(v.until, until) if until is not None else v.until
        return bool(mine)

    def _read_later(self, i, keys) -> bool:
        return any(r > i for k in keys for r, _ in self.readers.get(k, ()))

    def _message_follows(self, i) -> bool:
        return i + 1 < self.n and self.runs[i + 1][0] is None

    def passed(self, i) -> None:
        """Item i is not a graph (a send, a recv, a wait): drop the values held until it (a sent tensor the
        runtime lets go of after that receive)."""
        self.values = [v for v in self.values if v.until is None or v.until != i]


class _Versions:
    """The weight versions of an asynchronous window, from its items' labels (``F0.3@2``, ``STEP0@3``).

    ``steps``: item index -> (stage, version) of each update; :meth:`stashed_until` says how long the version an
    update replaces stays held: the runtime's ``VersionStore`` drops a version at the first update of its stage after
    the last F or B that names it, and the executor keeps the weights the stage's last forward read (their storages,
    to tell saved weights from activations) until a forward on another version has run."""

    def __init__(self, labels):
        self.steps: dict = {}
        self.last_use: dict = {}
        self.forwards: list = []              # (item index, stage, version) of each versioned F
        self.n = len(labels)
        for i, label in enumerate(labels):
            m = _VERSIONED.match(label) if isinstance(label, str) else None
            if m is None:
                continue
            kind, stage, version = m.group(1), int(m.group(2)), int(m.group(4))
            if kind == "STEP":
                self.steps[i] = (stage, version)
            elif kind in ("F", "B"):
                self.last_use[(stage, version)] = i
            if kind == "F":
                self.forwards.append((i, stage, version))

    def stashed_until(self, i):
        """The update at item i replaces its stage's newest version: the index of the item after which that version
        is freed, if a later F or B still names it; None if it goes at once."""
        stage, old = self.steps[i][0], self.steps[i][1] - 1
        last = self.last_use.get((stage, old), -1)
        ends = []
        if last > i:
            ends.append(next((j for j in sorted(self.steps) if j > last and self.steps[j][0] == stage), self.n))
        read = [v for j, s, v in self.forwards if s == stage and j < i]
        if read and read[-1] == old:
            ends.append(next((j for j, s, v in self.forwards if s == stage and j > i and v != old), self.n))
        return max(ends) if ends else None


def _category(st) -> str:
    """A value held between graphs: what forward made is an activation; else the category liveness gave it."""
    return "activation" if st.producer.meta.get(M.PHASE.name) == "forward" else st.category


def _placeholders(lv):
    return [st for st in lv.storages if st.producer.op == "placeholder"]


def sequence_peak(runs) -> tuple:
    """``(peak bytes, breakdown at the peak, index of the peak run)`` of one rank's step sequence.

    ``runs``: per item of the sequence, in order, ``(Liveness or None, label, keep)``; ``None`` marks an item
    that is not a graph (a send, a recv, a wait). ``keep`` says how long the graph's outputs stay: ``None``
    (default: by what the executor does with them, see the module docstring), a later item's label (e.g.
    ``"B0.3"`` for the activations ``"F0.3"`` saves), ``"end"``, or a dict ``{flat output index: label or
    "end"}`` (others default). An item may carry a fourth element, ``(bytes while it runs, bytes after its
    end)`` that the runtime makes for the graph outside it (``cost_models.Item.beside``). Labels of versioned actions
    (``F0.3@2``, ``STEP0@3``) mark an asynchronous window: each update replaces its stage's weights and state, frees
    the gradient accumulators it read, and leaves the weights it replaced held while a later F or B names their
    version. The breakdown: bytes at the peak by category (they add up to the peak; ``beside``: the item's own
    bytes outside its graph), and ``carried``: how many of them are values held from earlier graphs.
    """
    w = _Walk(runs)
    peak, best = w.base, None
    for i, (lv, _, keep, *rest) in enumerate(runs):
        if lv is None:
            w.passed(i)
            continue
        during, after = rest[0] if rest else (0.0, 0.0)
        own, own_end = w.own(i, lv)
        held, outside = w.held(), w.outside
        total = sum(held.values())
        extra = w.after(i, lv, keep)
        if w.base + total + own + during > peak:
            peak, best = w.base + total + own + during, (i, lv.peak_index, held, outside, 0.0, during)
        end = max(extra, after)
        if end and w.base + total + own_end + end > peak:
            peak, best = w.base + total + own_end + end, (i, len(lv.nodes) - 1, held, outside, extra, after)
    return peak, _breakdown(w, runs, best), best[0] if best else -1


def sequence_timeline(runs) -> tuple:
    """``(shared bytes, per graph item [(label, bytes while it runs, bytes after it, gradient accumulators' bytes
    while it runs, and after it)])`` of
    one rank's step sequence (``runs`` as for :func:`sequence_peak`), the walk's memory action by action. Shared
    bytes: the state and the batch, held throughout; the others count them too. "After it" is after the items that
    are not graphs up to the next graph too (a sent tensor let go of at a message item). ``max`` of the second column
    (and of an accumulator's first sum at a graph's end) is :func:`sequence_peak`'s peak."""
    w = _Walk(runs)
    out = []
    for i, (lv, label, keep, *rest) in enumerate(runs):
        if lv is None:
            w.passed(i)
            if out:
                after = w.held()
                out[-1] = out[-1][:2] + (w.base + sum(after.values()), out[-1][3], after.get("grad", 0.0))
            continue
        during, beside_after = rest[0] if rest else (0.0, 0.0)
        own, own_end = w.own(i, lv)
        held = w.held()
        total = sum(held.values())
        extra = w.after(i, lv, keep)
        after = w.held()
        out.append((label, w.base + total + max(own + during, own_end + max(extra, beside_after)),
                    w.base + sum(after.values()),
                    held.get("grad", 0.0), after.get("grad", 0.0)))
    return w.base, out


def _breakdown(w, runs, best) -> dict:
    out = dict.fromkeys(_CATEGORIES, 0.0)
    for cat, b in w.persistent.values():
        out[cat] += b
    out["input"] += w.batch
    out["carried"] = 0.0
    if best is None:
        return out
    i, at, held, outside, extra, beside = best
    lv = runs[i][0]
    for st in lv.storages:
        if st.start <= at <= st.end and st.category not in _PERSISTENT:
            out[st.category] = out.get(st.category, 0.0) + st.nbytes
        elif st.start <= at <= st.end:
            outside -= st.nbytes              # the graph's own state placeholders are counted once, above
    out["input"] -= outside                   # its inputs held elsewhere: the batch, carried values
    if extra >= beside:
        out["grad"] += extra
    else:
        out["beside"] = beside               # what the runtime makes for the graph outside it (Item.beside)
    for cat, b in held.items():
        out[cat] = out.get(cat, 0.0) + b
    out["carried"] = sum(held.values())
    return out
