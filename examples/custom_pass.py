"""Write your own pass and put it in fxpar's pipeline.

A pass is ``(GraphModule, PassContext) -> PassResult``. This one clips each synchronised
gradient's values to [-c, c] (a simple value clipping), inserted after fxpar's data-parallel
passes, so it sees the averaged gradients. It then shows the graph before and after it.

    python examples/custom_pass.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar import meta as M  # noqa: E402
from fxpar.testing import MLP  # noqa: E402


class ClipGradValues(fxpar.Pass):
    """Before: ``view_3 = view(slice_1, [32, 16])  # grad of layers.0.weight`` feeds the optimizer.
    After: ``clamp = clamp(view_3, -c, c)`` feeds it instead."""
    name = "clip_grad_values"

    def __init__(self, clip: float):
        self.clip = clip

    def run(self, gm, ctx):
        n = 0
        for grad in [node for node in gm.graph.nodes if M.get(node, M.GRAD_OF)]:
            users = [u for u in grad.users if u.op != "output"]      # the optimizer's uses
            with gm.graph.inserting_after(grad):
                clipped = gm.graph.call_function(torch.ops.aten.clamp.default, (grad, -self.clip, self.clip))
            clipped.meta["val"] = grad.meta["val"]
            for u in users:
                u.replace_input_with(grad, clipped)
            n += 1
        ctx.notes.append(f"clip_grad_values: clipped {n} gradients to +-{self.clip}")
        return fxpar.PassResult(gm, modified=n > 0)


def main():
    torch.manual_seed(0)
    model = MLP()
    batch = (torch.randn(8, 16), torch.randn(8, 8))
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batch, loss_fn=F.mse_loss,
                                optimizer=(torch.optim.SGD, {"lr": 0.1}),
                                strategy=fxpar.Strategy(dp=2, passes=[ClipGradValues(0.01)]))
    print(program.explain())
    history = program.history(rank=0)
    print("\npasses:", [h.pass_name for h in history])
    after = next(h for h in history if h.pass_name == "clip_grad_values").code
    print("\nlines the custom pass added:")
    print("\n".join(line for line in after.splitlines() if "clamp" in line))
    result = program.run_local([batch] * 3)
    print("\nlosses:", [round(x, 5) for x in result.losses])


if __name__ == "__main__":
    main()
