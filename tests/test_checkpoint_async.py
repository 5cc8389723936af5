"""Asynchronous saves, shared-out writes, hashing once per node, retention and save failures.

The reference state is always gathered with plain collectives at the moment of the save
(`full_states`), and every comparison is bit-exact: a background save must store exactly what the
model and optimizer held when `save_checkpoint` returned, whatever training did afterwards.
"""
import errno
from pathlib import Path

import pytest
import torch

import bigdense as bd
from bigdense.checkpoint import save as save_module
from bigdense.checkpoint.boxes import flat_range_boxes
from bigdense.testing import run_ranks

from helpers import TinyLM, assert_matches_reference, full_states, make_optimizer, train_steps


def _setup(tp):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = TinyLM()
    opt, sched = make_optimizer(model)
    train_steps(model, opt, sched, 0, 2)
    return ctx, model, opt, sched


def _async_save_then_keep_training(root):
    ctx, model, opt, sched = _setup(tp=2)
    reference = full_states(model, opt, ctx.tp_group)
    handle = bd.save_checkpoint(f"{root}/step_2", model, opt, scheduler=sched, step=2, async_=True)
    train_steps(model, opt, sched, 2, 4)  # changes every tensor while the save may still be writing
    assert handle.wait() == Path(root) / "step_2" and handle.done()
    bd.wait_for_checkpoints()  # nothing left in flight: returns at once
    # A second async save right after: the first is complete, the second commits too.
    second = bd.save_checkpoint(f"{root}/step_4", model, opt, scheduler=sched, step=4, async_=True)
    bd.destroy_parallel()  # waits for it
    assert second.done() and not second.failed
    return reference


def test_async_save_stores_the_state_of_the_call_while_training_changes_it(tmp_path):
    reference = run_ranks(_async_save_then_keep_training, 2, str(tmp_path), timeout=120)[0]
    assert (tmp_path / "latest").read_text().strip() == "step_4"
    torch.manual_seed(5)
    model = TinyLM()
    opt, _ = make_optimizer(model)
    assert bd.load_checkpoint(tmp_path / "step_2", model, opt).step == 2
    assert_matches_reference(model, opt, reference, "async save loaded at tp=1")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_flat_ranges_become_contiguous_boxes_that_tile_the_range():
    for shape in [(5,), (3, 4), (2, 3, 4), (4, 1, 3)]:
        n = torch.Size(shape).numel()
        t = torch.arange(n).reshape(shape)
        for start in range(n + 1):
            for end in range(start, n + 1):
                seen = []
                for off, box, flat in flat_range_boxes(shape, start, end):
                    part = t
                    for d, (o, k) in enumerate(zip(off, box)):
                        part = part.narrow(d, o, k)
                    assert torch.equal(part.reshape(-1), torch.arange(flat, flat + part.numel()))
                    seen += part.reshape(-1).tolist()
                assert sorted(seen) == list(range(start, end))


# ---- hashing once per node -------------------------------------------------------------------


def _save_tp2(root):
    ctx, model, opt, sched = _setup(tp=2)
    bd.save_checkpoint(f"{root}/ck", model, opt, step=2)
    return full_states(model, opt, ctx.tp_group)


def _load_dp2(root, reference, verify):
    ctx = bd.init_parallel(tp=1)  # 2 ranks: tp=1 x dp=2, another layout than the saved tp=2
    torch.manual_seed(9)
    model = TinyLM()
    opt, _ = make_optimizer(model)
    info = bd.load_checkpoint(f"{root}/ck", model, opt, verify=verify)
    assert_matches_reference(model, opt, reference, f"verify={verify} rank {ctx.rank}")
    return info.bytes_hashed, info.bytes_copied


def test_each_stored_byte_is_hashed_once_per_node_by_default(tmp_path):
    reference = run_ranks(_save_tp2, 2, str(tmp_path), timeout=120)[0]
    ckpt = tmp_path / "ck"
    import json

    manifest = json.loads((ckpt / "manifest.json").read_text())
    shard_bytes = sum(4 * max(1, torch.Size(s["shape"]).numel()) for e in manifest["tensors"].values()
                      for s in e["shards"])  # every tensor is fp32 here
    hashed = {mode: run_ranks(_load_dp2, 2, str(tmp_path), reference, mode, timeout=120)
              for mode in ("all", "node", "first", "none")}
    # Both ranks need every tensor whole (tp=1), so both read every stored shard.
    assert [h for h, _ in hashed["all"]] == [shard_bytes, shard_bytes]
    assert sum(h for h, _ in hashed["node"]) == shard_bytes and max(h for h, _ in hashed["node"]) < shard_bytes
    assert [h for h, _ in hashed["first"]] == [shard_bytes, 0]
    assert [h for h, _ in hashed["none"]] == [0, 0]
    assert all(c == shard_bytes for mode in hashed.values() for _, c in mode)


def _load_corrupted(root):
    bd.init_parallel(tp=1)
    model = TinyLM()
    with pytest.raises(bd.CheckpointError, match="fails its checksum"):
        bd.load_checkpoint(f"{root}/ck", model)  # only one rank hashes the broken shard; both must refuse
    return True


def test_a_corrupted_shard_hashed_by_one_rank_fails_the_load_on_every_rank(tmp_path):
    run_ranks(_save_tp2, 2, str(tmp_path), timeout=120)
    f = tmp_path / "ck" / "model-tp01-of-02.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert run_ranks(_load_corrupted, 2, str(tmp_path), timeout=120) == [True, True]


def test_verify_values_outside_the_documented_set_are_refused(tmp_path):
    model = TinyLM()
    bd.save_checkpoint(tmp_path / "ck", model)
    with pytest.raises(ValueError, match=r"verify=.sometimes. is not one of \['node', 'first', 'all', 'none'\]"):
        bd.load_checkpoint(tmp_path / "ck", model, verify="sometimes")


# ---- save failures, bad targets, retention -----------------------------------------------------


def _full_disk_on_rank_1(path, layout, produce, metadata=None):
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    raise OSError(errno.ENOSPC, "No space left on device")


def _save_onto_full_disk(root, async_):
    ctx, model, opt, sched = _setup(tp=2)
    bd.save_checkpoint(f"{root}/step_2", model, opt, step=2)
    if ctx.rank == 1:
        save_module.write_safetensors = _full_disk_on_rank_1
    with pytest.raises(bd.CheckpointError) as info:
        result = bd.save_checkpoint(f"{root}/step_3", model, opt, step=3, async_=async_)
        if async_:
            result.wait()
    train_steps(model, opt, sched, 2, 3)  # training goes on
    return str(info.value)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_latest(tmp_path, async_):
    messages = run_ranks(_save_onto_full_disk, 2, str(tmp_path), async_, timeout=120)
    for message in messages:
        assert "filesystem is full" in message and "model-tp01-of-02.safetensors" in message, message
        assert "rank 1" in message
    assert (tmp_path / "latest").read_text().strip() == "step_2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2"]  # the partial files are gone
    assert bd.load_checkpoint(tmp_path / "latest", TinyLM()).step == 2


def test_saving_onto_something_that_is_not_a_checkpoint_is_refused(tmp_path):
    model = TinyLM()
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"1")
    for name in ("notes.txt", "data"):
        with pytest.raises(bd.CheckpointError, match=f"{tmp_path / name} exists and is not a bigdense checkpoint"):
            bd.save_checkpoint(tmp_path / name, model)
    assert (tmp_path / "notes.txt").read_text() == "keep me" and (tmp_path / "data" / "x.bin").exists()
    # Re-saving a checkpoint's name replaces it and leaves nothing hidden behind.
    bd.save_checkpoint(tmp_path / "ck", model, step=1)
    bd.save_checkpoint(tmp_path / "ck", model, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "data", "latest", "notes.txt"]
    with pytest.raises(bd.CheckpointError, match="keep_last must be a positive integer, got 0"):
        bd.save_checkpoint(tmp_path / "ck", model, keep_last=0)


def test_keep_last_removes_older_checkpoints_but_never_latest(tmp_path):
    model = TinyLM()
    for step in (1, 2, 3):
        bd.save_checkpoint(tmp_path / f"step_{step}", model, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2", "step_3"]
    # A checkpoint saved without moving `latest` still counts; `latest`'s own target survives.
    bd.save_checkpoint(tmp_path / "step_4", model, step=4, keep_last=1, update_latest=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_4"]
    assert bd.load_checkpoint(tmp_path / "latest", model).step == 3
