"""Cross-iteration overlap at run time (``passes.comm_schedule``): a step's gradient pieces are carried, un-waited,
into the next step, which waits for them and applies their update just before each parameter's first forward use.

A mixin of :class:`fxpar.runtime.executor.Executor`. The stage's graphs are ``FIRST`` (the first step: nothing
carried, no update), ``FULL`` (the steady step: ``("carry", piece)`` inputs and outputs, with the previous step's
LR and count) and ``DRAIN`` (only the carried waits and update), which :meth:`drain` runs after the last step
and before results, ``state_dict`` and checkpoints.
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

    def _carry_args(self, sg, s, carry, mb) -> list:
        args = []
        for role, key in sg.inputs:
            if role == "opt_state":
                args.append(self.state[s][key])
            elif role in ("lr", "step"):
                args.append(carry[role])
            elif role == "carry":
                args.append(carry["pieces"][key])
            else:
                args.append(self._input(role, key, s, self.params[s], mb, {}))
        return args

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
            sg = self.p.graphs[s]["DRAIN"]
            res = sg.gm(*self._carry_args(sg, s, carry, None))
            for (role, key), v in zip(sg.outputs, res):
                self._take(s, role, key, v)
            self._settle(s)
        self.__dict__["carry"] = {}

