"""fxpar on a GPU: dp, 1F1B, tp, ZeRO-3 + offload and the compiled backend, each against single-process training
on the same device, with the device memory each rank used against the memory model's prediction and step times
beside torch DDP.

    python benchmarks/gpu_check.py                       # every check on cuda:0 (ranks share the one GPU over gloo)
    python benchmarks/gpu_check.py --device cpu          # the same script on CPU ranks (a dry run of the script)
    python benchmarks/gpu_check.py --only dp,tp --out d  # some checks; a JSON line per check under d/

Ranks share one GPU over gloo: gloo moves host memory, so fxpar stages each collective and each pipeline send of a
device tensor through the host (``fxpar.collectives.stage_through_host``) -- what a one-GPU machine can show is
that the per-rank programs compute the right thing on CUDA, what they hold in device memory, and how long a step
takes; not how fast a real interconnect makes them (NCCL needs one GPU per rank). ``nccl1`` runs one NCCL rank.

Each check runs in a process of its own (one hang or crash costs that check alone) with a time limit. Per check:
* ``parity f64``: the largest |difference| of the losses and of the trained parameters against single-process
  training in float64 (a tiny GPT), and ``parity f32`` the same, relative, for the timed float32 model (``dp_bf16``:
  bf16 compute with float32 masters against float32 training -- bf16's rounding, not parity);
* ``peak MiB``: ``torch.cuda.max_memory_allocated`` of each rank during its training steps, less what the rank held
  before its program was built (the user's own model on the device), against ``program.estimate()``'s
  ``peak_memory_bytes`` for that rank (``pred MiB``);
* ``step ms``: the median step time of the float32 model (slowest rank), after warm-up; ``ddp`` is torch's
  DistributedDataParallel on the same ranks, model and batch.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHECKS = {   # name -> (world size, backend, strategy keyword arguments)
    "dp": (2, "gloo", dict(dp=2)),
    "1f1b": (2, "gloo", dict(pp=2, schedule="1f1b", microbatches=4)),
    "tp": (2, "gloo", dict(tp=2, sharding="megatron")),
    "zero3_offload": (2, "gloo", dict(dp=2, zero=3, offload=("params", "optimizer"))),
    "dp_bf16": (2, "gloo", dict(dp=2, precision="bf16")),
    "compile": (2, "gloo", dict(dp=2, compile=True)),
    "nccl1": (1, "nccl", dict(dp=1)),
    "compile_nccl1": (1, "nccl", dict(dp=1, compile=True)),
    "ddp": (2, "gloo", None),          # torch DDP: the baseline's step time
}
STEPS, WARMUP = 8, 3
# the timed float32 model: GPT-2-like, 4 layers of width 512 over 256 tokens, 16 sequences a step (on CPU, for a
# dry run of the script, a small one)
F32 = dict(vocab=4096, d=512, layers=4, heads=8, max_seq=256)
BATCH, SEQ = 16, 256
if os.environ.get("FXPAR_GPU_CHECK_DEVICE") == "cpu":
    F32, BATCH, SEQ = dict(vocab=256, d=64, layers=2, heads=4, max_seq=32), 8, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster(device: str, world: int, backend: str):
    import torch
    import fxpar
    from fxpar.cluster import DeviceSpec
    if device == "cpu":
        return fxpar.ClusterSpec.local(world)
    p = torch.cuda.get_device_properties(0)
    # one GPU's figures (H100/H200 SXM: 989 TFLOP/s bf16 dense, HBM3/HBM3e; float32 runs far under the bf16 peak,
    # so the time figures of estimate() are not the point here: its memory figures are)
    dev = DeviceSpec("cuda", p.name, int(p.total_memory), 989e12, 4.8e12 if "H200" in p.name else 3.35e12)
    return fxpar.ClusterSpec(device=dev, nodes=1, devices_per_node=world, backend=backend)


def _batches(n: int, vocab: int, batch: int, seq: int, device: str, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g).to(device),
             torch.randint(0, vocab, (batch, seq), generator=g).to(device)) for _ in range(n)]


def _model(kind: str, device: str):
    import torch
    from fxpar.testing import GPT
    torch.manual_seed(0)
    if kind == "f64":
        return GPT(vocab=64, d=32, layers=2, heads=4, max_seq=16).double().to(device)
    return GPT(**F32).to(device)


def _sync(device):
    import torch
    if device != "cpu":
        torch.cuda.synchronize()


def _ddp_rank(device, batches, opt):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fxpar.testing import gpt_loss
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(_model("f32", device))
    o = opt[0](model.parameters(), **opt[1])
    times = []
    for b in batches:
        x, y = (t.chunk(world)[rank] for t in b)
        _sync(device)
        t0 = time.perf_counter()
        o.zero_grad()
        gpt_loss(model(x), y).backward()
        o.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"times": times}


def _fxpar_rank(device, kind, strategy, batches, opt, cluster):
    import torch
    import torch.distributed as dist
    import fxpar
    from fxpar.testing import gpt_loss
    rank = dist.get_rank()
    model = _model(kind, device)
    base = torch.cuda.memory_allocated() if device != "cpu" else 0
    program = fxpar.parallelize(model, cluster, batches[0], loss_fn=gpt_loss, optimizer=opt,
                                strategy=fxpar.Strategy(**strategy))
    runner = program.runner()
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for b in batches:
        _sync(device)
        t0 = time.perf_counter()
        losses.append(runner.step(b))
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base if device != "cpu" else None
    state = runner.state_dict()          # collective: every rank
    out = {"losses": losses, "times": times, "peak": peak}
    if rank == 0:
        out["pred"] = [r.peak_memory_bytes for r in program.estimate().ranks]
        out["state"] = {k: v.detach().cpu() for k, v in state.items()}
        st = runner.executor.features.get("compile")
        if st is not None:             # per graph: compiled, or why it ran eager
            rep = st.report() or {}
            out["compiled"] = {str(k): {kk: vv for kk, vv in (v.items() if isinstance(v, dict) else [("v", v)])
                                        if kk != "code"} for k, v in (rep.items() if isinstance(rep, dict) else [])}
    return out


def _rank_main(rank: int, world: int, port: int, name: str, device: str, backend: str, outdir: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if device != "cpu":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=rank, world_size=world)
    _, _, strategy = CHECKS[name]
    cluster = _cluster(device, world, backend)
    res = {}
    try:
        if strategy is None:
            res["f32"] = _ddp_rank(device, _batches(STEPS, F32["vocab"], BATCH, SEQ, device, 1),
                                   (torch.optim.AdamW, {"lr": 1e-3}))
        else:
            if "precision" not in strategy:        # bf16 compute is not float64 parity: the f32 phase compares it
                res["f64"] = _fxpar_rank(device, "f64", strategy, _batches(3, 64, 8, 16, device, 2),
                                         (torch.optim.AdamW, {"lr": 1e-2}), cluster)
            res["f32"] = _fxpar_rank(device, "f32", strategy, _batches(STEPS, F32["vocab"], BATCH, SEQ, device, 1),
                                     (torch.optim.AdamW, {"lr": 1e-3}), cluster)
    except Exception:
        res["error"] = traceback.format_exc()[-3000:]
    torch.save(res, os.path.join(outdir, f"{name}.rank{rank}.pt"))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


def _reference(kind: str, device: str, batches, opt):
    from fxpar.testing import gpt_loss, reference_training
    return reference_training(_model(kind, device), batches, gpt_loss, opt)


def _diff(losses, ref_losses, state, ref_state) -> dict:
    dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
    rl = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses))
    dp = max(float((state[k].double() - ref_state[k].detach().cpu().double()).abs().max()) for k in ref_state)
    scale = max(float(ref_state[k].detach().abs().max()) for k in ref_state)
    return {"loss_abs": dl, "loss_rel": rl, "param_abs": dp, "param_rel": dp / scale}


def run_check(name: str, device: str, outdir: str) -> dict:
    """One check, in this process: spawn the ranks, then compare with single-process training here."""
    import torch
    import torch.multiprocessing as mp
    world, backend, strategy = CHECKS[name]
    if strategy is not None:
        import fxpar
        try:
            fxpar.Strategy(**strategy)
        except Exception as e:          # an option this build does not have (the compiled backend)
            return {"check": name, "status": "not built", "why": f"Strategy({strategy}): {e}"}
    if backend == "nccl" and device == "cpu":
        return {"check": name, "status": "skipped", "why": "NCCL needs CUDA"}
    mp.start_processes(_rank_main, args=(world, _free_port(), name, device, backend, outdir), nprocs=world,
                       start_method="spawn", join=True)
    ranks = [torch.load(os.path.join(outdir, f"{name}.rank{r}.pt"), weights_only=False) for r in range(world)]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"check": name, "status": "error", "why": errors[0]}
    out = {"check": name, "status": "ran", "world": world, "backend": backend}
    f32 = [r["f32"] for r in ranks]
    steps = [max(r["times"][i] for r in f32) for i in range(STEPS)]
    out["step_ms"] = 1e3 * statistics.median(steps[WARMUP:])
    if strategy is None:
        return out
    opt64, opt32 = (torch.optim.AdamW, {"lr": 1e-2}), (torch.optim.AdamW, {"lr": 1e-3})
    if "f64" in ranks[0]:
        r64 = _reference("f64", device, _batches(3, 64, 8, 16, device, 2), opt64)
        out["parity_f64"] = _diff(ranks[0]["f64"]["losses"], r64[0], ranks[0]["f64"]["state"], r64[1])
    b32 = _batches(STEPS, F32["vocab"], BATCH, SEQ, device, 1)
    r32 = _reference("f32", device, b32, opt32)
    out["parity_f32"] = _diff(ranks[0]["f32"]["losses"], r32[0], ranks[0]["f32"]["state"], r32[1])
    out["peak_mib"] = [None if r["peak"] is None else r["peak"] / 2**20 for r in f32]
    out["pred_mib"] = [p / 2**20 for p in ranks[0]["f32"]["pred"]]
    out["compiled"] = ranks[0]["f32"].get("compiled")
    if device != "cpu":       # single-process step time of the same model, for scale
        import time as _t
        m = _model("f32", device)
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        from fxpar.testing import gpt_loss
        ts = []
        for x, y in b32:
            torch.cuda.synchronize()
            t0 = _t.perf_counter()
            o.zero_grad()
            gpt_loss(m(x), y).backward()
            o.step()
            torch.cuda.synchronize()
            ts.append(_t.perf_counter() - t0)
        out["single_ms"] = 1e3 * statistics.median(ts[WARMUP:])
    return out


def _fmt(r: dict) -> str:
    if r["status"] != "ran":
        why = r.get("why", "").strip().splitlines()
        return f"{r['check']:<14} {r['status']}: {why[-1] if why else ''}"
    cols = [f"{r['check']:<14}", f"step {r['step_ms']:8.2f} ms"]
    if "parity_f32" in r:
        p64, p32 = r.get("parity_f64"), r["parity_f32"]
        cols += [f"f64 loss {p64['loss_abs']:.1e} param {p64['param_abs']:.1e}" if p64 else "f64 -",
                 f"f32 loss(rel) {p32['loss_rel']:.1e} param(rel) {p32['param_rel']:.1e}"]
        if r["peak_mib"][0] is not None:
            cols.append("peak/pred MiB " + " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(r["peak_mib"], r["pred_mib"])))
        if "single_ms" in r:
            cols.append(f"single {r['single_ms']:.2f} ms")
        if r.get("compiled"):
            cols.append("compiled: " + json.dumps(r["compiled"])[:600])
    return "  ".join(cols)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks: " + ", ".join(CHECKS))
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per check")
    ap.add_argument("--run-check", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.run_check:
        res = run_check(a.run_check, a.device, a.out)
        print("RESULT " + json.dumps(res), flush=True)
        return
    os.environ["FXPAR_GPU_CHECK_DEVICE"] = a.device       # the check processes and their ranks size the model by it
    import torch
    print(f"torch {torch.__version__}, device {a.device}"
          + (f" ({torch.cuda.get_device_name(0)})" if a.device == "cuda" else ""), flush=True)
    results = []
    for name in a.only.split(","):
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--run-check", name, "--device", a.device, "--out", a.out],
                               capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {"check": name, "status": "crashed",
                                                           "why": (p.stderr or p.stdout)[-3000:]}
        except subprocess.TimeoutExpired as e:
            res = {"check": name, "status": "timeout", "why": f"over {a.timeout:.0f} s; "
                   + ((e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))[-2000:]}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        with open(os.path.join(a.out, "gpu_check.jsonl"), "a") as f:
            f.write(json.dumps(res) + "\n")
        print(_fmt(res) + f"  [{res['wall_s']} s]", flush=True)
        if res["status"] in ("error", "crashed", "timeout"):
            print("  " + res.get("why", "")[-1500:].replace("\n", "\n  "), flush=True)
    print("\nsummary")
    for r in results:
        print(_fmt(r))


if __name__ == "__main__":
    main()
