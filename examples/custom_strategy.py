"""Write your own strategy: a gradient-sync method with per-rank state, as one Feature in one file.

The method: each data-parallel rank sends its gradient buckets in a narrower dtype (float16 by default)
and keeps what the rounding dropped, adding it back before the next step's rounding -- error feedback
(Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019):

    p_r = g_r + e_r          (g_r: rank r's bucket, already scaled by 1/dp; e_r: its residual, 0 at first)
    c_r = round(p_r)         (to ``ef_dtype``)
    e_r <- p_r - c_r         (kept on rank r for the next step)
    g   = sum_r c_r          (one all-reduce in ``ef_dtype``: half the bytes of float32)

With ``ef_dtype`` equal to the gradients' own dtype the rounding is exact, e_r stays 0, and the method is
plain synchronous data parallelism.

Everything the strategy is lives below: its Strategy option (``ef_dtype``), its Plan section (the dtype and
each stage's bucket sizes, JSON round-trip), its planning (after capture, the buckets' sizes), its pass (in
the BUCKET_SUM slot: rewrites how each bucket is summed), its per-rank state (the residuals: graph inputs and
outputs, saved in checkpoints), its cost effect (the residuals' bytes) and its lines in ``explain()``.
``reference_training`` is the method's math in one process, the oracle the tests compare against.

    python examples/custom_strategy.py
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import fxpar
from fxpar import meta as M
from fxpar.collectives import C10D
from fxpar.feature import add_state_input, add_state_output
from fxpar.testing import MLP

aten = torch.ops.aten
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


@dataclass
class ErrorFeedbackSection(fxpar.PlanSection):
    """The decisions: the dtype buckets travel in; per stage, each bucket's number of values."""
    dtype: str = "float16"
    bucket_numels: list = field(default_factory=list)

    def lines(self) -> list:
        n = sum(sum(b) for b in self.bucket_numels)
        return [f"gradient buckets all-reduced in {self.dtype} with error feedback (a residual of {n} values per "
                "rank carried to the next step)"]


def _bucket_key(stage: int, bucket: int) -> str:
    return f"s{stage}b{bucket}"


class ErrorFeedbackSum(fxpar.Pass):
    """Each bucket's all-reduce, rewritten to send the rounded bucket plus residual.

    Before (one bucket)::

        empty = empty([n]); ... copy_(slot, grad) ...
        all_reduce_ = all_reduce_(empty, 'sum', 'fxpar:dp'); wait_tensor = wait_tensor(all_reduce_)

    After::

        add = add(empty, state_ef16_s0b0)                        # p = g + e
        _to_copy = _to_copy(add, dtype=float16)                  # c = round(p)
        _to_copy_1 = _to_copy(_to_copy, dtype=float64); sub = sub(add, _to_copy_1)   # e' = p - c: new_state
        all_reduce_ = all_reduce_(_to_copy, 'sum', 'fxpar:dp'); wait_tensor = wait_tensor(all_reduce_)
        _to_copy_2 = _to_copy(wait_tensor, dtype=float64)        # what the optimizer reads
    """
    name = "error_feedback_sum"
    requires = ("bucket",)

    def run(self, gm, ctx):
        section = ctx.plan.section(ErrorFeedback.name)
        dtype = _DTYPES[section.dtype]
        g = gm.graph
        buckets = {M.get(n, M.BUCKET): n for n in g.nodes if n.target is C10D.all_reduce_.default
                   and M.get(n, M.BUCKET) is not None}
        numels = section.bucket_numels[ctx.stage]
        if sorted(buckets) != list(range(len(numels))):
            raise fxpar.PassError(f"error_feedback_sum: stage {ctx.stage} has all-reduce buckets {sorted(buckets)}, "
                                  f"but the Plan section planned {len(numels)}: plan again (parallelize without plan=)")
        for b, ar in sorted(buckets.items()):
            buf = ar.args[0]
            val = buf.meta["val"]
            if val.numel() != numels[b]:
                raise fxpar.PassError(f"error_feedback_sum: stage {ctx.stage} bucket {b} holds {val.numel()} values, "
                                      f"the Plan section {numels[b]}")
            wait = next(u for u in ar.users if u.target is C10D.wait_tensor.default)
            err = add_state_input(gm, ErrorFeedback.name, _bucket_key(ctx.stage, b), val.new_empty(val.shape))
            issue = {M.PHASE.name: M.get(ar, M.PHASE), M.REDUCE_GRAD.name: M.get(ar, M.REDUCE_GRAD)}
            with g.inserting_before(ar):
                p = g.call_function(aten.add.Tensor, (buf, err))
                c = g.call_function(aten._to_copy.default, (p,), {"dtype": dtype})
                back = g.call_function(aten._to_copy.default, (c,), {"dtype": val.dtype})
                new_err = g.call_function(aten.sub.Tensor, (p, back))
            for node, v in ((p, val), (c, val.to(dtype)), (back, val), (new_err, val)):
                node.meta.update({"val": v, **{k: x for k, x in issue.items() if x is not None}})
            ar.replace_input_with(buf, c)
            info = M.get(ar, M.COMM)
            M.set_meta(ar, M.COMM, M.CommInfo(info.kind, info.axis, info.ranks, c.meta["val"].numel()
                                              * c.meta["val"].element_size(), info.reduce_op))
            with g.inserting_after(wait):
                up = g.call_function(aten._to_copy.default, (wait,), {"dtype": val.dtype})
            up.meta.update({"val": val, **{k: x for k, x in ((M.PHASE.name, M.get(wait, M.PHASE)),
                                                                (M.REDUCE_GRAD.name, M.get(wait, M.REDUCE_GRAD)))
                                            if x is not None}})
            wait.replace_all_uses_with(up, delete_user_cb=lambda u: u is not up)
            add_state_output(gm, ErrorFeedback.name, _bucket_key(ctx.stage, b), new_err)
        ctx.notes.append(f"error_feedback_sum: {len(buckets)} bucket(s) all-reduced in {section.dtype}, residuals kept")
        return fxpar.PassResult(gm, modified=bool(buckets))


class Residuals(fxpar.RankState):
    """One residual per bucket of every stage this rank holds, zeros at first (``info``: key -> (numel, dtype))."""

    def __init__(self, info, rank):
        super().__init__(info, rank)
        self.tensors = {k: torch.zeros(n, dtype=getattr(torch, dt)) for k, (n, dt) in info.items()}


@fxpar.register_feature
class ErrorFeedback(fxpar.Feature):
    name = "ef16"
    doc = "gradient buckets all-reduced in a narrow dtype with error feedback (Seide et al. 2014)"
    options = {"ef_dtype": fxpar.Option(None, "the dtype gradient buckets travel in ('float16', 'bfloat16', ...)")}
    section = ErrorFeedbackSection
    requires = ("data_parallel",)        # it rewrites how data parallelism's buckets are summed
    # features that change those buckets or sum them another way: Strategy(...) refuses each, naming both features
    conflicts_with = ("zero", "tensor_parallel", "herring", "byteps", "parallax", "bytescheduler")
    passes = ((fxpar.Slot.BUCKET_SUM, ErrorFeedbackSum),)
    state = Residuals

    def validate(self, strategy):
        if strategy.ef_dtype not in _DTYPES:
            raise fxpar.StrategyError(f"Strategy(ef_dtype={strategy.ef_dtype!r}): choose one of {sorted(_DTYPES)}")
        if strategy.dp < 2:
            raise fxpar.StrategyError(f"Strategy(ef_dtype={strategy.ef_dtype!r}) rewrites data parallelism's "
                                      f"all-reduce buckets: it needs dp >= 2 (dp={strategy.dp})")

    def plan(self, strategy, plan, cluster):
        return ErrorFeedbackSection(dtype=strategy.ef_dtype)

    def plan_stage(self, section, plan, stage, captured, cluster, schedule):
        numel = lambda k: int(torch.Size(captured.param_shapes[k]).numel())      # noqa: E731
        while len(section.bucket_numels) <= stage:
            section.bucket_numels.append([])
        section.bucket_numels[stage] = [sum(numel(k) for k in b) for b in plan.section("data_parallel").buckets[stage]]

    def rank_info(self, section, program, rank):
        out = {}
        for s in program.plan.rank_stages(rank):
            cap = program.stages[s].captured
            dtype = str(next(iter(cap.param_dtypes.values()))).replace("torch.", "")
            for b, n in enumerate(section.bucket_numels[s]):
                out[_bucket_key(s, b)] = (n, dtype)
        return out or None

    def state_bytes(self, section, program, rank):
        info = self.rank_info(section, program, rank) or {}
        return sum(n * torch.empty((), dtype=getattr(torch, dt)).element_size() for n, dt in info.values())

    def explain(self, section, program):
        lines = section.lines()
        for s, sizes in enumerate(section.bucket_numels):
            lines.append(f"stage {s}: {len(sizes)} bucket(s) of {sizes} values, each sent as {section.dtype}")
        return lines


def reference_training(model, batches, loss_fn, lr: float, dp: int, dtype: str, microbatches: int = 1):
    """The method's math in one process, with SGD: each of ``dp`` shards (cut into ``microbatches``) makes its
    gradient scaled by 1/(dp * microbatches), adds its residual, rounds to ``dtype``; the rounded values are
    summed in ``dtype`` (shard order), and the sum updates every replica. Returns (losses, state_dict)."""
    m = copy.deepcopy(model)
    params = [p for p in m.parameters() if p.requires_grad]
    narrow = _DTYPES[dtype]
    err = [[torch.zeros_like(p) for p in params] for _ in range(dp)]
    losses = []
    for batch in batches:
        *inputs, target = batch
        n = target.shape[0] // dp
        sent, total = [], 0.0
        for r in range(dp):
            shard = [t[r * n:(r + 1) * n] for t in (*inputs, target)]
            acc = None
            for mb in zip(*(t.chunk(microbatches) for t in shard)):
                loss = loss_fn(m(*mb[:-1]), mb[-1])
                total += loss.item() / (dp * microbatches)
                grads = torch.autograd.grad(loss / (dp * microbatches), params)
                acc = list(grads) if acc is None else [a + g for a, g in zip(acc, grads)]
            rounded = []
            for i, g in enumerate(acc):
                p = g + err[r][i]
                c = p.to(narrow)
                err[r][i] = p - c.to(p.dtype)
                rounded.append(c)
            sent.append(rounded)
        with torch.no_grad():
            for i, w in enumerate(params):
                s = sent[0][i]
                for r in range(1, dp):
                    s = s + sent[r][i]
                w -= lr * s.to(w.dtype)
        losses.append(total)
    return losses, m.state_dict()


def main():
    torch.manual_seed(0)
    model = MLP().double()
    batches = [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)) for _ in range(4)]
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss,
                                optimizer=(torch.optim.SGD, {"lr": 0.1}),
                                strategy=fxpar.Strategy(dp=2, ef_dtype="float16"))
    print(program.explain())
    result = program.run_local(batches)
    ref_losses, _ = reference_training(model, batches, F.mse_loss, lr=0.1, dp=2, dtype="float16")
    print("\nlosses    :", [round(x, 6) for x in result.losses])
    print("reference :", [round(x, 6) for x in ref_losses])


if __name__ == "__main__":
    main()
