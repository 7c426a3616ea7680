"""The roles of graph inputs and outputs, and the kinds of graphs a schedule calls: one place, typed.

Every graph fxpar runs lists, for each input and output, a ``(role, key)`` pair (``StepSignature`` for a joint
graph, ``SplitGraph.inputs`` / ``.outputs`` for the graphs cut from it). The runtime reads nothing else: the
role says where an input's value comes from and where an output goes. Capture, the passes and the runtime write
and test the members (``Role.PARAM``), never the strings.

Both enums are ``str`` enums that equal and hash as their value, so a member and its string find the same dict
entry either way (``{Role.PARAM: 0}["param"]``, ``{"F": g}[GraphKind.F]``); ``str()`` and ``repr()`` give the value's,
so messages and printed signatures read ``('param', 'w')``; JSON writes the value, and a value read back becomes
a member again with ``Role(value)``.

==================  =========  ==============================================================================
role                 where      value (key)
==================  =========  ==============================================================================
``PARAM``            input      the rank's parameter (model key)
``PARAM_SHARD``      input      this rank's ZeRO chunk of a parameter (model key)
``FORWARD_PARAM``    input      the weights a forward computes with where a feature supplies them (model key):
                                a prediction of later weights (linear weight prediction)
``BACKWARD_PARAM``   input      the weights a backward differentiates through where the forward saved none
                                (model key): an asynchronous schedule without weight stashing supplies them
``BUFFER``           input      a buffer (model key)
``OPT_STATE``        input      optimizer state (``"<state>:<model key>"``)
``LR``, ``STEP``     input      the learning rate and the step count, float64 scalars the executor makes
``INPUT``            input      a batch column of the microbatch (position)
``TARGET``           input      a target column of the microbatch (position)
``ACT``              input      an activation received from the previous stage (its name in the forward trace)
``TANGENT``          input      the gradient of an activation this stage sent, received from the next stage
``SAVED``            both       what ``F`` (or ``I``) keeps for a later graph of the same microbatch
``UNSHARDED``        both       a parameter ``UNSHARD`` gathered once per step (ZeRO-3 under a pipeline)
``GRAD``             both       a parameter's gradient: per microbatch out of ``B``/``W``, summed by the runtime,
                                into ``REDUCE_GRAD``/``STEP``; or a synchronised gradient out of a per-step graph
``PENDING``          both       a collective ``REDUCE_GRAD`` started and ``STEP`` waits on
``CARRY``            both       a gradient piece carried, un-waited, into the next step (cross-iteration overlap)
``STATE``            input      a feature's per-rank state (``"<feature>.<name>"``): its ``RankState`` provides it
``LOSS``             output     the microbatch's loss
``NEW_PARAM``        output     a parameter after the update
``NEW_BUFFER``       output     a buffer after the step
``NEW_OPT_STATE``    output     optimizer state after the update
``ACT_GRAD``         output     the gradient of a received activation, sent back to the previous stage
``NEW_STATE``        output     a feature's per-rank state for the next step (back to its ``RankState``)
==================  =========  ==============================================================================
"""
from __future__ import annotations

import enum

__all__ = ["Role", "GraphKind"]


class Role(str, enum.Enum):
    PARAM = "param"
    PARAM_SHARD = "param_shard"
    FORWARD_PARAM = "forward_param"
    BACKWARD_PARAM = "backward_param"
    BUFFER = "buffer"
    OPT_STATE = "opt_state"
    LR = "lr"
    STEP = "step"
    INPUT = "input"
    TARGET = "target"
    ACT = "act"
    TANGENT = "tangent"
    SAVED = "saved"
    UNSHARDED = "unsharded"
    GRAD = "grad"
    PENDING = "pending"
    CARRY = "carry"
    STATE = "state"
    LOSS = "loss"
    NEW_PARAM = "new_param"
    NEW_BUFFER = "new_buffer"
    NEW_OPT_STATE = "new_opt_state"
    ACT_GRAD = "act_grad"
    NEW_STATE = "new_state"

    __hash__ = str.__hash__          # the value's: a member and its string are one dict key

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


class GraphKind(str, enum.Enum):
    """The graphs a stage's joint graph is cut into (``passes.split_graphs``), by the action that calls each.

    These are the core kinds. A feature that cuts graphs of its own names them with its own strings, declared once
    by the passes that cut them and never a core kind's name (the cross-iteration carry's first-step, drain and
    forward-with-update graphs); a stage's graph dict may then hold both."""
    FULL = "FULL"                  # the whole step as one graph (one stage, one microbatch)
    UNSHARD = "UNSHARD"            # ZeRO-3 under a pipeline: the stage's parameters gathered once per step
    F = "F"                        # forward, once per microbatch
    B = "B"                        # backward, once per microbatch
    I = "I"                        # noqa: E741 - zero bubble: the input gradients the previous stage needs
    W = "W"                        # zero bubble: the weight gradients
    REDUCE_GRAD = "REDUCE_GRAD"    # the gradient collectives' issue, once per step
    STEP = "STEP"                  # their waits and the update, once per step

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)
