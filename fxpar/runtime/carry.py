"""Cross-iteration overlap at run time (``passes.comm_schedule``): a step's gradient pieces are carried, un-waited,
into the next step, which waits for them and applies their update just before each parameter's first forward use.

A mixin of :class:`fxpar.runtime.executor.Executor`. The stage's graphs are ``FIRST`` (the first step: nothing
carried, no update), ``FULL`` (the steady step: ``("carry", piece)`` inputs and outputs, with the previous step's
LR and count) and ``DRAIN`` (only the carried waits and update), which :meth:`drain` runs after the last step
and before results, ``state_dict`` and checkpoints.

With split graphs (a pipeline, or several microbatches: ``passes.carry_step``) the stage's ``STEP`` action keeps
its inputs (:meth:`_defer_step`: the pieces ``REDUCE_GRAD`` issued, the summed gradients, LR and count), the
stage's first ``F`` of the next step runs ``F_UPDATE`` (the update, bucket by bucket, inside that forward), and
:meth:`drain` runs the kept ``STEP``.
"""
from __future__ import annotations

import torch

__all__ = ["CarryState"]


class CarryState:
    def _full_carry(self, a, w):
        """``FULL`` with ``("carry", piece)`` inputs and outputs: waits for and applies the previous step's update
        (with that step's LR and count) before each parameter's first forward use, then trains this step and
        hands its pieces on. The first step (nothing carried) runs ``FIRST``; :meth:`drain` runs ``DRAIN``."""
        s, i = a.stage, a.microbatch
        carry = self.__dict__.setdefault("carry", {}).pop(s, None)
        sg = self.p.graphs[s]["FULL" if carry else "FIRST"]
        self.step_count[s] += 1
        lr = torch.tensor(float(self.torch_opt.param_groups[0]["lr"]), dtype=torch.float64)
        cnt = torch.tensor(float(self.step_count[s]), dtype=torch.float64)
        self._note_state_bytes(w, s)
        res = sg.gm(*self._carry_args(sg, s, carry, w.micro[i]))
        pieces = {}
        for (role, key), v in zip(sg.outputs, res):
            if role == "loss":
                w.loss_sums[i // w.per_batch] += float(v)
            elif role == "carry":
                pieces[key] = v
            else:
                self._take(s, role, key, v)
        self.carry[s] = {"pieces": pieces, "lr": lr, "step": cnt}
        self._settle(s)

    def _carry_args(self, sg, s, carry, mb, acts=None) -> list:
        args = []
        for role, key in sg.inputs:
            if role == "opt_state":
                args.append(self.state[s][key])
            elif role in ("lr", "step"):
                args.append(carry[role])
            elif role == "carry":
                args.append(carry["pieces"][key])
            elif role in ("grad", "pending"):
                args.append(carry[role][key])
            else:
                args.append(self._input(role, key, s, self.params[s], mb, acts or {}))
        return args

    # ---- with split graphs (a pipeline, several microbatches): STEP moves into the next first F ----------
    def _defer_step(self, a, w) -> None:
        """STEP under cross-iteration overlap with ``F_UPDATE``: keep what the update reads -- the collectives
        REDUCE_GRAD started (not waited), the summed gradients, this step's LR and count -- for the stage's first
        forward of the next step (``F_UPDATE``) or :meth:`drain` (which runs ``STEP`` itself)."""
        s = a.stage
        self.step_count[s] += 1
        pend = w.pending.pop(s, {})
        kept = {"lr": torch.tensor(float(self.torch_opt.param_groups[0]["lr"]), dtype=torch.float64),
                "step": torch.tensor(float(self.step_count[s]), dtype=torch.float64), "grad": {}, "pending": pend}
        for role, key in self.p.graphs[s]["STEP"].inputs:
            if role == "grad":
                kept["grad"][key] = self._step_grad(w, s, key)
            elif role == "pending" and key not in pend:
                raise RuntimeError(f"rank {self.rank}: STEP{s} waits on a gradient collective ({key}) that no RG{s} "
                                   f"started in this step: put RG{s} after the stage's last backward and before STEP{s} "
                                   "in the schedule (fxpar.schedule.ensure_reduce_grad adds it).")
        self.__dict__.setdefault("carry", {})[s] = kept

    def _forward_update(self, s, w, mb, acts):
        """The stage's first F of a step after a deferred STEP: ``F_UPDATE`` waits for the previous step's pieces and
        applies its update bucket by bucket, each just before the first forward op on those parameters, and runs
        the forward on the new parameters. Returns ``(graph, arguments, results)``; the forward's outputs are the
        caller's."""
        carry = self.carry.pop(s)
        sg = self.p.graphs[s]["F_UPDATE"]
        self._note_state_bytes(w, s)
        args = self._carry_args(sg, s, carry, mb, acts)
        res = sg.gm(*args)
        self._take_update(s, sg, res)
        return sg, args, res

    def _take_update(self, s, sg, res) -> None:
        new = dict(self.params[s])           # a new dict: a window may still hold the old one
        for (role, key), v in zip(sg.outputs, res):
            if role == "new_param":
                new[key] = v
            elif role == "new_opt_state":
                self.state[s][key] = v
        self.params[s] = new
        self._settle(s)

    def _take(self, s, role, key, v) -> None:
        if role == "new_param":
            self.params[s][key] = v
        elif role == "new_buffer":
            self.buffers[key] = v
        elif role == "new_opt_state":
            self.state[s][key] = v

    def drain(self) -> None:
        """Collective (every rank of the stage): wait for the pieces carried out of the last step and apply its
        update (``DRAIN``), so parameters and optimizer state are those of single-process training. Before
        results, ``state_dict`` and checkpoints; the next step starts afresh (``FIRST``)."""
        for s, carry in sorted(self.__dict__.get("carry", {}).items()):
            if "pending" in carry:           # split graphs: the deferred STEP itself
                sg = self.p.graphs[s]["STEP"]
                self._take_update(s, sg, sg.gm(*self._carry_args(sg, s, carry, None)))
                continue
            sg = self.p.graphs[s]["DRAIN"]
            res = sg.gm(*self._carry_args(sg, s, carry, None))
            for (role, key), v in zip(sg.outputs, res):
                self._take(s, role, key, v)
            self._settle(s)
        self.__dict__["carry"] = {}
        for st in self.features.values():          # the features' own work in flight
            st.drain(self)

