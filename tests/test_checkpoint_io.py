"""fxpar.runtime.checkpoint: DCP save/load under model keys, across world sizes, with a safe commit; a CRC-32 per
tensor checked on load (a file damaged in place is refused, naming it and the tensor); faults during a save (a
full disk, a process killed during the write) leave the previous checkpoint loadable and the unfinished one
refused by name; a resume refuses NaN parameters."""
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fxpar.runtime import checkpoint as ck
from fxpar.runtime.checkpoint import CheckpointError, is_complete, load_checkpoint, save_checkpoint


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 3, bias=False).double()


def _model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    m = _Tiny()
    m.norm.running_mean.uniform_()
    m.norm.num_batches_tracked.fill_(5)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _full_state(seed: int) -> dict:
    """Model keys plus Adam-like optimizer state under optim.<state>.<key>."""
    s = _model_state(seed)
    g = torch.Generator().manual_seed(seed + 1)
    for k, v in list(s.items()):
        if v.is_floating_point() and k != "norm.running_var":
            s[ck.optim_key("exp_avg", k)] = torch.randn(v.shape, generator=g, dtype=v.dtype)
            s[ck.optim_key("step", k)] = torch.tensor(3.0)
    return s


def _split(state: dict) -> tuple[list, list]:
    """Rank 0 holds A (blocks.0) and B (blocks.1); rank 1 holds B and C (norm, head): B is replicated."""
    a = [k for k in state if "blocks.0." in k]
    b = [k for k in state if "blocks.1." in k]
    c = [k for k in state if k not in a and k not in b]
    return a + b, b + c


def _bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(-1).view(torch.uint8),
                                                                     y.contiguous().view(-1).view(torch.uint8))


# --------------------------------------------------------------- rank functions (module level)

def _rank_save(path, tensors, step):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000 + rank)
    torch.rand(2)
    sched_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=2)
    for _ in range(step):
        sched.step()
    extra = {"rng": ck.rng_state(), "step": step, "rank": rank, "scheduler": sched.state_dict()}
    save_checkpoint(path, tensors, extra, rank=rank, world_size=world)
    return torch.rand(3)   # what this rank draws next, after the saved RNG state


def _rank_load(path, templates):
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        tensors, extra = load_checkpoint(path, templates, rank=rank, world_size=world)
    except CheckpointError as e:
        return "error", str(e)
    ck.set_rng_state(extra["rng"])
    return tensors, extra, torch.rand(3)


def _rank_save_killed(path, tensors):
    """rank 0 'dies' after DCP wrote the data, before the manifest: every rank must get the error."""
    rank = dist.get_rank()
    real = ck._write_manifest

    def crash(*a, **k):
        raise OSError("simulated kill before the manifest")
    if rank == 0:
        ck._write_manifest = crash
    try:
        save_checkpoint(path, tensors, {}, rank=rank, world_size=2)
        return "saved"
    except CheckpointError as e:
        return str(e)
    finally:
        ck._write_manifest = real


# --------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def saved(clusters, tmp_path_factory):
    """One checkpoint saved by 2 gloo ranks holding overlapping key sets."""
    path = str(tmp_path_factory.mktemp("ckpt") / "step7")
    state = _full_state(0)
    k0, k1 = _split(state)
    nxt = clusters.get(2).run(_rank_save, [(path, {k: state[k] for k in k0}, 7),
                                           (path, {k: state[k] for k in k1}, 7)])
    return path, state, nxt


@pytest.mark.numerics
def test_manifest_and_layout(saved):
    path, state, _ = saved
    assert is_complete(path)
    m = ck.read_manifest(path)
    assert m["version"] == ck.FORMAT_VERSION and m["world_size"] == 2
    assert sorted(m["tensors"]) == sorted(state)
    assert m["tensors"]["head.weight"] == {"shape": [3, 4], "dtype": "float64"}
    assert not os.path.exists(path + ".fxpar-partial") and not os.path.exists(path + ".fxpar-old")


@pytest.mark.numerics
def test_load_in_one_process_without_group(saved):
    path, state, _ = saved
    assert not dist.is_initialized()
    templates = {k: torch.zeros_like(v) for k, v in state.items()}
    tensors, extra = load_checkpoint(path, templates, rank=0, world_size=1)
    assert sorted(tensors) == sorted(state)
    for k, v in state.items():
        assert _bitwise_equal(tensors[k], v), k
        assert templates[k].count_nonzero() == 0   # templates are not written
    assert extra["rank"] == 0 and extra["step"] == 7 and extra["scheduler"]["last_epoch"] == 7


@pytest.mark.numerics
def test_load_on_two_ranks_with_another_split_and_rng_per_rank(saved, clusters):
    path, state, nxt = saved
    keys = sorted(state)
    want = [sorted(set(keys[::2]) | {"head.weight"}), sorted(set(keys[1::2]) | {"head.weight"})]  # one on both
    res = clusters.get(2).run(_rank_load, [(path, {k: torch.empty_like(state[k]) for k in w}) for w in want])
    for r, (tensors, extra, drawn) in enumerate(res):
        assert sorted(tensors) == sorted(want[r])
        for k in want[r]:
            assert _bitwise_equal(tensors[k], state[k]), (r, k)
        assert extra["rank"] == r
        assert torch.equal(drawn, nxt[r])           # RNG state restored per rank
    assert not torch.equal(nxt[0], nxt[1])


@pytest.mark.numerics
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_pytorch_dcp_load_into_module(saved):
    path, state, _ = saved
    assert not dist.is_initialized()
    torch.manual_seed(123)
    m = _Tiny()
    dcp.load(m.state_dict(), checkpoint_id=path)   # extra optim.* / fxpar.* entries are not asked for
    for k, v in m.state_dict().items():
        assert _bitwise_equal(v, state[k]), k
    assert int(m.norm.num_batches_tracked) == 5


@pytest.mark.numerics
def test_missing_key_and_wrong_shape_are_refused(saved):
    path, state, _ = saved
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, {"blocks.0.fc.weigth": torch.zeros(4, 4)}, rank=0, world_size=1)
    assert "'blocks.0.fc.weigth'" in str(e.value) and "'blocks.0.fc.weight'" in str(e.value)
    with pytest.raises(CheckpointError, match=r"head.weight.*float64\[3, 4\].*float32\[3, 4\]"):
        load_checkpoint(path, {"head.weight": torch.zeros(3, 4)}, rank=0, world_size=1)


@pytest.mark.numerics
def test_one_rank_missing_a_key_fails_every_rank(saved, clusters):
    path, state, _ = saved
    res = clusters.get(2).run(_rank_load, [(path, {"head.weight": state["head.weight"]}),
                                           (path, {"head.wieght": state["head.weight"]})])
    assert res[0][0] == "error" and res[1][0] == "error"
    assert "rank 1" in res[0][1] and "'head.weight'" in res[0][1]
    assert "'head.wieght'" in res[1][1]


@pytest.mark.structure
def test_killed_save_keeps_previous_and_refuses_half_written(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    v1, v2 = _model_state(1), _model_state(2)
    save_checkpoint(path, v1, {"step": 1}, rank=0, world_size=1)

    def crash(*a, **k):
        raise OSError("simulated kill")
    monkeypatch.setattr(ck, "_write_manifest", crash)
    with pytest.raises(CheckpointError, match="could not commit"):
        save_checkpoint(path, v2, {"step": 2}, rank=0, world_size=1)
    monkeypatch.undo()

    partial = path + ".fxpar-partial"
    assert os.path.isdir(partial) and not is_complete(partial) and is_complete(path)
    tensors, extra = load_checkpoint(path, {k: torch.empty_like(v) for k, v in v1.items()}, rank=0, world_size=1)
    assert extra == {"step": 1} and all(_bitwise_equal(tensors[k], v1[k]) for k in v1)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(partial, {"head.weight": v1["head.weight"]}, rank=0, world_size=1)
    msg = str(e.value)
    assert partial in msg and "incomplete" in msg and f"previous checkpoint {path}" in msg and "delete" in msg

    # a checkpoint directory whose manifest is gone is refused too
    broken = str(tmp_path / "broken")
    shutil.copytree(path, broken)
    os.remove(os.path.join(broken, ck.MANIFEST))
    assert not is_complete(broken)
    with pytest.raises(CheckpointError, match="broken is incomplete.*delete"):
        load_checkpoint(broken, {"head.weight": v1["head.weight"]}, rank=0, world_size=1)

    # the next save cleans the leftovers and replaces the checkpoint
    save_checkpoint(path, v2, {"step": 2}, rank=0, world_size=1)
    tensors, extra = load_checkpoint(path, {"head.weight": v2["head.weight"]}, rank=0, world_size=1)
    assert extra == {"step": 2} and _bitwise_equal(tensors["head.weight"], v2["head.weight"])
    assert sorted(os.listdir(tmp_path)) == ["broken", "ck"]


@pytest.mark.numerics
def test_killed_save_on_two_ranks(tmp_path, clusters):
    path = str(tmp_path / "ck")
    v1, v2 = _model_state(1), _model_state(2)
    k0, k1 = _split(v1)
    lc = clusters.get(2)
    lc.run(_rank_save, [(path, {k: v1[k] for k in k0}, 1), (path, {k: v1[k] for k in k1}, 1)])
    msgs = lc.run(_rank_save_killed, [(path, {k: v2[k] for k in k0}), (path, {k: v2[k] for k in k1})])
    assert all("could not commit" in m and "simulated kill" in m for m in msgs), msgs
    assert is_complete(path) and not is_complete(path + ".fxpar-partial")
    tensors, extra = load_checkpoint(path, {k: torch.empty_like(v) for k, v in v1.items()}, rank=0, world_size=1)
    assert extra["step"] == 1 and all(_bitwise_equal(tensors[k], v1[k]) for k in v1)


@pytest.mark.numerics
def test_overwrite_and_world_size_change(tmp_path, clusters):
    path = str(tmp_path / "ck")
    v1, v2 = _model_state(1), _model_state(2)
    save_checkpoint(path, v1, {"step": 1}, rank=0, world_size=1)
    save_checkpoint(path, v2, {"step": 2}, rank=0, world_size=1)
    assert os.listdir(tmp_path) == ["ck"]
    # saved by 1 rank, loaded by 2: rank r gets the extra of saved rank r % 1 == 0
    res = clusters.get(2).run(_rank_load_no_rng, [(path, {"blocks.1.fc.bias": v1["blocks.1.fc.bias"]})] * 2)
    for tensors, extra in res:
        assert extra == {"step": 2} and _bitwise_equal(tensors["blocks.1.fc.bias"], v2["blocks.1.fc.bias"])
    # a directory that is not a checkpoint is never replaced
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not an fxpar checkpoint"):
        save_checkpoint(str(foreign), v1, {}, rank=0, world_size=1)
    assert (foreign / "notes.txt").read_text() == "keep me"


def _rank_load_no_rng(path, templates):
    return load_checkpoint(path, templates, rank=dist.get_rank(), world_size=dist.get_world_size())


@pytest.mark.structure
def test_torch_optimizer_round_trip(tmp_path):
    torch.manual_seed(0)
    m = _Tiny()
    keys = [k for k, _ in m.named_parameters()]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(8, 4)

    def step(model, o):
        o.zero_grad()
        h = model.norm(model.blocks[1].fc(model.blocks[0].fc(x)))
        model.head(h.double()).sum().backward()
        o.step()
    step(m, opt)
    sched.step()
    opt_tensors, rest = ck.torch_optimizer_tensors(opt.state_dict(), keys)
    assert ck.optim_key("exp_avg_sq", "head.weight") in opt_tensors
    assert ck.split_optim_key("optim.exp_avg.blocks.0.fc.weight") == ("exp_avg", "blocks.0.fc.weight")
    save_checkpoint(str(tmp_path / "ck"), {**m.state_dict(), **opt_tensors},
                    {"optim": rest, "scheduler": sched.state_dict()}, rank=0, world_size=1)

    torch.manual_seed(1)
    m2 = _Tiny()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    templates = {**m2.state_dict(), **{k: torch.empty_like(v) for k, v in opt_tensors.items()}}
    tensors, extra = load_checkpoint(str(tmp_path / "ck"), templates, rank=0, world_size=1)
    m2.load_state_dict({k: tensors[k] for k in m2.state_dict()})
    opt2.load_state_dict(ck.torch_optimizer_state_dict(opt2, keys, tensors, extra["optim"]))
    sched2.load_state_dict(extra["scheduler"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-3
    step(m, opt)
    step(m2, opt2)
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert _bitwise_equal(a, b), k


# --------------------------------------------------------------- integrity and faults

def _dcp_item(path, key):
    """(data file, offset, length) of ``key`` in a DCP checkpoint, from its own index."""
    info = next(i for idx, i in dcp.FileSystemReader(path).read_metadata().storage_data.items() if idx.fqn == key)
    return os.path.join(path, info.relative_path), info.offset, info.length


@pytest.mark.structure
def test_a_damaged_file_is_refused_naming_the_file_and_the_tensor(tmp_path):
    path = str(tmp_path / "ck")
    state = {**_model_state(1), "big": torch.randn(64, 64, dtype=torch.float64)}
    save_checkpoint(path, state, {"step": 1}, rank=0, world_size=1)
    sums = ck.read_manifest(path)["checksums"]
    assert sums["big"]["crc32"] == ck.checksum(state["big"]) and sums["big"]["file"].endswith(".distcp")
    assert "fxpar.extra.rank0" in sums and ck.read_manifest(path)["tensors"]["big"] == {"shape": [64, 64],
                                                                                       "dtype": "float64"}
    templates = {k: torch.empty_like(v) for k, v in state.items()}
    file, offset, length = _dcp_item(path, "big")
    with open(file, "r+b") as f:                       # 64 bytes overwritten in place: the file keeps its size
        f.seek(offset + length // 2)
        f.write(b"\xff" * 64)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, templates, rank=0, world_size=1)
    msg = str(e.value)
    assert "damaged" in msg and "'big'" in msg and os.path.basename(file) in msg and "previous checkpoint" in msg
    # a key that was not damaged still loads
    got, _ = load_checkpoint(path, {"head.weight": templates["head.weight"]}, rank=0, world_size=1)
    assert _bitwise_equal(got["head.weight"], state["head.weight"])


@pytest.mark.structure
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno
    import torch.distributed.checkpoint.filesystem as fs
    path = str(tmp_path / "ck")
    v1, v2 = _model_state(1), _model_state(2)
    save_checkpoint(path, v1, {"step": 1}, rank=0, world_size=1)
    real, calls = fs._write_item, []

    def write_until_full(*a, **k):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)
    monkeypatch.setattr(fs, "_write_item", write_until_full)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(path, v2, {"step": 2}, rank=0, world_size=1)
    monkeypatch.undo()
    msg = str(e.value)
    assert "disk is full" in msg and "previous checkpoint" in msg and "Free space" in msg and path in msg
    assert is_complete(path) and not is_complete(path + ".fxpar-partial")
    tensors, extra = load_checkpoint(path, {k: torch.empty_like(v) for k, v in v1.items()}, rank=0, world_size=1)
    assert extra == {"step": 1} and all(_bitwise_equal(tensors[k], v1[k]) for k in v1)


_KILLED_SAVE = """
import sys, time, torch
import torch.distributed.checkpoint.filesystem as fs
from fxpar.runtime.checkpoint import save_checkpoint
path = sys.argv[1]
state = {f"w{i}": torch.full((256, 256), float(i), dtype=torch.float64) for i in range(8)}
save_checkpoint(path, state, {"step": 1}, rank=0, world_size=1)
real, n = fs._write_item, []
def slow(*a, **k):
    n.append(1)
    out = real(*a, **k)
    if len(n) == 3:                    # halfway through the data file: tell the test, then wait to be killed
        a[1].flush()
        print("writing", flush=True)
        time.sleep(60)
    return out
fs._write_item = slow
save_checkpoint(path, {k: v + 1 for k, v in state.items()}, {"step": 2}, rank=0, world_size=1)
"""


@pytest.mark.structure
@pytest.mark.slow
def test_a_save_killed_during_the_write_is_refused_by_name(tmp_path):
    import signal
    import subprocess
    import sys
    path = str(tmp_path / "ck")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, path], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "writing"
        partial = path + ".fxpar-partial"
        assert any(f.endswith(".distcp") for f in os.listdir(partial))       # the write is under way
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    templates = {f"w{i}": torch.empty(256, 256, dtype=torch.float64) for i in range(8)}
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(partial, templates, rank=0, world_size=1)
    msg = str(e.value)
    assert partial in msg and "incomplete" in msg and f"previous checkpoint {path}" in msg
    tensors, extra = load_checkpoint(path, templates, rank=0, world_size=1)       # the previous one is intact
    assert extra == {"step": 1} and all(bool((tensors[f"w{i}"] == i).all()) for i in range(8))


@pytest.mark.numerics
@pytest.mark.slow
def test_a_checkpoint_with_nan_parameters_is_refused_on_resume(tmp_path):
    import fxpar
    from fxpar.testing import SkipMLP, class_batches
    model, batches = SkipMLP().double(), class_batches(4, seed=2)
    opt = (torch.optim.AdamW, {"lr": 1e-2})
    prog = fxpar.parallelize(model, 1, batches[0], torch.nn.functional.cross_entropy, opt)
    prog.run_local(batches[:2], save_to=tmp_path / "ck")
    manifest = ck.read_manifest(tmp_path / "ck")
    templates = {k: torch.empty(m["shape"], dtype=getattr(torch, m["dtype"])) for k, m in manifest["tensors"].items()}
    tensors, extra = load_checkpoint(tmp_path / "ck", templates, rank=0, world_size=1)
    key = next(k for k in tensors if k.endswith("weight") and not k.startswith("optim."))
    tensors[key][0, 0] = float("nan")                  # a diverged run's parameter, saved with a valid checksum
    save_checkpoint(tmp_path / "nan", tensors, extra, rank=0, world_size=1)
    with pytest.raises(CheckpointError, match=rf"parameter '{key}' .* NaN or inf .*1 of .*earlier checkpoint"):
        prog.run_local(batches[2:], resume_from=tmp_path / "nan")
