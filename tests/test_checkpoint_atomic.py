"""A save killed at any moment leaves nothing that loads; bad checkpoints fail on every rank, untouched.

Crash points are forced by replacing one function of the save module inside one rank with a
version that SIGKILLs the process there: in the middle of writing a shard file, after every file
and the manifest are written but before the rename, and after the rename but before ``latest``
moves; in a background save, while the training thread goes on. The previous complete
checkpoint must stay what ``latest`` names and must load.
"""
import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest
import torch

import bigdense as bd
from bigdense.checkpoint import save as save_module
from bigdense.testing import RankError, run_ranks

from helpers import (
    TinyLM, assert_matches_reference, full_states, local_states, make_optimizer, train_steps,
)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _half_written_shard(path, layout, produce, metadata=None):
    with open(path, "wb") as f:
        f.write(b"\0" * 100)  # the start of a shard file, then the process is gone
    _die()


def _tp2_after_one_step():
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = TinyLM()
    opt, sched = make_optimizer(model)
    train_steps(model, opt, sched, 0, 1)
    return ctx, model, opt, sched


def _save_then_crash(root, crash_point):
    async_ = crash_point.startswith("async-")
    crash_point = crash_point.removeprefix("async-")
    ctx, model, opt, sched = _tp2_after_one_step()
    bd.save_checkpoint(f"{root}/step_1", model, opt, step=1)
    reference = full_states(model, opt, ctx.tp_group)
    train_steps(model, opt, sched, 1, 2)
    if crash_point == "mid-shard" and ctx.rank == 1:
        save_module.write_safetensors = _half_written_shard
    if crash_point == "before-rename" and ctx.rank == 0:
        save_module.fsync_dir = lambda path: _die()  # first called once the manifest is written
    if crash_point == "before-latest" and ctx.rank == 0:
        save_module.replace_text_durably = lambda *a, **k: _die()
    # The parent learns the reference through a file: this run never returns normally.
    if ctx.rank == 0:
        torch.save(reference, f"{root}/reference.pt")
    torch.distributed.barrier()
    handle = bd.save_checkpoint(f"{root}/step_2", model, opt, step=2, async_=async_)
    if async_:  # the kill comes from the background thread while this one trains on
        train_steps(model, opt, sched, 2, 3)
        handle.wait()
    return "not killed"


@pytest.mark.parametrize("crash_point", ["mid-shard", "before-rename", "before-latest", "async-mid-shard",
                                         "async-before-rename"])
def test_a_save_killed_midway_leaves_latest_on_the_previous_complete_checkpoint(tmp_path, crash_point):
    with pytest.raises(RankError, match="died without reporting"):
        run_ranks(_save_then_crash, 2, str(tmp_path), crash_point, timeout=120, collective_timeout=20)
    reference = torch.load(tmp_path / "reference.pt")

    assert (tmp_path / "latest").read_text().strip() == "step_1"
    torch.manual_seed(5)
    model = TinyLM()
    opt, _ = make_optimizer(model)
    info = bd.load_checkpoint(tmp_path / "latest", model, opt)
    assert info.step == 1
    assert_matches_reference(model, opt, reference, "loaded at tp=1 after the crash")

    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".step_2.tmp-")]
    crash_point = crash_point.removeprefix("async-")
    if crash_point == "before-latest":
        assert leftovers == []  # the rename happened: step_2 is complete, merely not `latest` yet
        assert bd.load_checkpoint(tmp_path / "step_2", model, opt).step == 2
    else:
        assert not (tmp_path / "step_2").exists()
        # Killed before the rename: if rank 0 died, the temporary directory (manifest included) is
        # left behind and refused; if rank 1 died, the surviving rank 0 removed it.
        if crash_point == "before-rename":
            assert len(leftovers) == 1
            # Every file and the manifest were written: resuming by the checkpoint's name finds the
            # complete copy under its temporary name and loads it where it is.
            torch.manual_seed(6)
            resumed = TinyLM()
            resumed_opt, _ = make_optimizer(resumed)
            assert bd.load_checkpoint(tmp_path / "step_2", resumed, resumed_opt).step == 2
        # mid-shard: rank 1 died, so either rank 0 removed the directory or it is left: both fine.
        for leftover in leftovers:
            with pytest.raises(bd.CheckpointError, match="unfinished save"):
                bd.load_checkpoint(leftover, model, opt)
        # What the next attempt at the same save (after a restart) finds: it cleans up and commits.
        bd.save_checkpoint(tmp_path / "step_2", model, opt, step=2)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        assert (tmp_path / "latest").read_text().strip() == "step_2"


class _DieOnSecondRename:
    """``os`` for the save module whose second ``rename`` kills the process before renaming: a
    re-save of an existing name dies between moving the old copy aside and moving the new one in."""

    def __init__(self):
        self.renames = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def rename(self, src, dst):
        self.renames += 1
        if self.renames == 2:
            _die()
        os.rename(src, dst)


def _resave_then_crash(root):
    ctx, model, opt, sched = _tp2_after_one_step()
    bd.save_checkpoint(f"{root}/last", model, opt, step=1)
    train_steps(model, opt, sched, 1, 2)
    if ctx.rank == 0:
        torch.save(full_states(model, opt, ctx.tp_group), f"{root}/reference.pt")
        save_module.os = _DieOnSecondRename()
    else:
        full_states(model, opt, ctx.tp_group)  # a collective: rank 0 needs its peer here
    bd.save_checkpoint(f"{root}/last", model, opt, step=2)  # the same name again


def test_a_resave_killed_between_its_renames_rolls_forward(tmp_path):
    with pytest.raises(RankError, match="died without reporting"):
        run_ranks(_resave_then_crash, 2, str(tmp_path), timeout=120, collective_timeout=20)
    assert not (tmp_path / "last").exists()  # the crash hit the window: neither copy under the name
    reference = torch.load(tmp_path / "reference.pt")
    torch.manual_seed(5)
    model = TinyLM()
    opt, _ = make_optimizer(model)
    # The new copy is complete (its manifest was written before the swap): it is what loads, through
    # `latest` and by the checkpoint's own name alike...
    assert bd.load_checkpoint(tmp_path / "latest", model, opt).step == 2
    assert_matches_reference(model, opt, reference, "loaded through latest from the copy a dead re-save left")
    torch.manual_seed(6)
    by_name = TinyLM()
    by_name_opt, _ = make_optimizer(by_name)
    assert bd.load_checkpoint(tmp_path / "last", by_name, by_name_opt).step == 2
    assert_matches_reference(by_name, by_name_opt, reference, "loaded by name from the copy a dead re-save left")
    # ...and the next save of that name moves it into place before writing.
    bd.save_checkpoint(tmp_path / "last", model, opt, step=3)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert bd.load_checkpoint(tmp_path / "latest", model, opt).step == 3


# ---- bad checkpoints ----------------------------------------------------------------------------


def _save_good(root):
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = TinyLM()
    opt, sched = make_optimizer(model)
    train_steps(model, opt, sched, 0, 2)
    bd.save_checkpoint(f"{root}/good", model, opt, step=2)


def _flip_byte_in(file: Path, tensor: str):
    """Flip one byte in the middle of ``tensor``'s data in a safetensors file."""
    raw = bytearray(file.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + header_len])[tensor]["data_offsets"]
    raw[8 + header_len + (begin + end) // 2] ^= 0xFF
    file.write_bytes(bytes(raw))


def _make_bad_copies(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """``{case: (checkpoint dir, words its error message must contain)}``."""
    good = root / "good"
    cases = {}

    def copy(name):
        shutil.copytree(good, root / name)
        return root / name

    d = copy("corrupted")
    _flip_byte_in(d / "model-tp01-of-02.safetensors", "mlp.up.weight")
    cases["corrupted"] = (d, ["model-tp01-of-02.safetensors", "mlp.up.weight", "checksum"])
    d = copy("truncated")
    f = d / "optim-tp00-of-02.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    cases["truncated"] = (d, ["optim-tp00-of-02.safetensors", "truncated"])
    d = copy("missing_file")
    (d / "model-tp01-of-02.safetensors").unlink()
    cases["missing_file"] = (d, ["model-tp01-of-02.safetensors", "missing"])
    d = copy("missing_shard")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["tensors"]["model/mlp.down.weight"]["shards"].pop()  # the tp01 shard of a row-parallel weight
    (d / "manifest.json").write_text(json.dumps(manifest))
    cases["missing_shard"] = (d, ["model/mlp.down.weight", "shard is missing"])
    d = copy("no_manifest")
    (d / "manifest.json").unlink()
    cases["no_manifest"] = (d, ["no_manifest", "not a complete bigdense checkpoint"])
    (root / "run_without_checkpoint" / "checkpoints").mkdir(parents=True)
    cases["run_without_checkpoint"] = (root / "run_without_checkpoint",
                                       ["is a run directory, but", "holds no complete checkpoint yet"])
    (root / "no_pointer").mkdir()
    shutil.copytree(good, root / "no_pointer" / "step_0000003")
    cases["no_pointer"] = (root / "no_pointer", ["holds checkpoints but no `latest` pointer",
                                                 str(root / "no_pointer" / "step_0000003")])
    d = copy("bad_common")
    (d / "common.pt").write_bytes(b"x" * (d / "common.pt").stat().st_size)
    cases["bad_common"] = (d, ["common.pt", "checksum"])
    return cases


class OtherShapeLM(TinyLM):
    """The same names, a different global shape (hidden 12 instead of 10)."""

    def __init__(self):
        super().__init__()
        self.mlp = bd.ParallelMLP(6, 12, "swiglu")


class OtherNamesLM(TinyLM):
    def __init__(self):
        super().__init__()
        self.final_norm = self.norm
        del self.norm

    def forward(self, ids, target):
        raise NotImplementedError


def _try_bad_loads(cases):
    bd.init_parallel(tp=2)
    torch.manual_seed(7)
    model = TinyLM()
    opt, sched = make_optimizer(model)
    train_steps(model, opt, sched, 0, 1)  # give the optimizer state that a half-load would change
    others = {"other_shape": OtherShapeLM(), "other_names": OtherNamesLM()}  # (building them draws from the RNG)
    before = local_states(model, opt)
    rng_before = torch.get_rng_state()
    messages = {}
    for name, (path, _) in cases.items():
        with pytest.raises(bd.CheckpointError) as info:
            bd.load_checkpoint(path, model, opt)
        assert not isinstance(info.value, bd.CheckpointMismatch), name  # a bad file, not another model
        messages[name] = str(info.value)
    for name, other in others.items():
        path = Path(next(iter(cases.values()))[0]).parent / "good"
        with pytest.raises(bd.CheckpointMismatch) as info:  # on every rank, through the agreement
            bd.load_checkpoint(path, other)
        messages[name] = str(info.value)
    after = local_states(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load modified the model"
    assert torch.equal(rng_before, torch.get_rng_state())
    return messages


def test_bad_checkpoints_fail_on_every_rank_with_file_and_tensor_named_and_nothing_loaded(tmp_path):
    run_ranks(_save_good, 2, str(tmp_path), timeout=120)
    cases = _make_bad_copies(tmp_path)
    expected = {name: words for name, (_, words) in cases.items()}
    expected["other_shape"] = ["mlp.gate.weight", "[10, 6]", "[12, 6]", "another model"]
    expected["other_names"] = ["another model", "final_norm.weight", "norm.weight"]
    per_rank = run_ranks(_try_bad_loads, 2, {k: (str(p), w) for k, (p, w) in cases.items()}, timeout=120)
    for rank, messages in enumerate(per_rank):
        for case, words in expected.items():
            for word in words:
                assert word in messages[case], f"rank {rank}, {case}: {word!r} not in: {messages[case]}"


def test_a_run_directory_its_checkpoints_and_its_pointer_all_name_the_latest_checkpoint(tmp_path):
    from bigdense.checkpoint.format import resolve_checkpoint

    step = tmp_path / "run" / "checkpoints" / "step_0000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    (step.parent / "latest").write_text("step_0000004")
    for given in (tmp_path / "run", step.parent, step.parent / "latest", step):
        assert resolve_checkpoint(given) == step, given
