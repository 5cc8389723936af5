"""`python -m bigdense.bench.fsdp` measures what it says, at a tiny size (tp=2 x dp=2 on 4 gloo
processes): counts and bytes only, never times.

The GPT below has every dimension even, so FSDP pads nothing and its shards are exactly half of
each TP-local tensor: memory and collective bytes can then be pinned to the parameters' bytes."""
import pytest

from bigdense.bench import fsdp
from bigdense.testing import run_ranks

SHAPE = dict(d=64, layers=2, heads=4, vocab=512, max_seq=32)
SEQ, GLOBAL_BATCH = 32, 8


def _tp_local_bytes_and_count():
    """Bytes of each TP rank's parameters (fp32) and the number of parameter tensors, from a model
    built the same way (both TP ranks hold the same number: the GPT's TP splits are even)."""
    out = run_ranks(_tp_local_rank, 2)
    assert out[0] == out[1]
    return out[0]


def _tp_local_rank():
    import bigdense as bd

    ctx = bd.init_parallel(tp=2)
    model = fsdp._gpt(ctx, **SHAPE)
    params = list(model.parameters())
    return sum(p.numel() * p.element_size() for p in params), len(params)


@pytest.fixture(scope="module")
def param_bytes():
    return _tp_local_bytes_and_count()


@pytest.fixture(scope="module")
def memory():
    return {kind: run_ranks(fsdp.memory_rank, 4, kind, SHAPE, 16, 2, timeout=300) for kind in fsdp.ENGINES}


@pytest.fixture(scope="module")
def comm():
    return run_ranks(fsdp.comm_rank, 4, SHAPE, SEQ, GLOBAL_BATCH, (1, 2), 2, 0, timeout=300)


def test_fsdp_holds_half_of_ddp_parameters_gradients_and_adamw_state(memory, param_bytes):
    total, n = param_bytes
    steps = 4 * n  # AdamW's fp32 step counter per parameter, kept whole by both engines
    for r in memory["ddp"]:
        assert r["held"] == {"params": total, "grads": total, "optim": 2 * total + steps,
                             "total": 4 * total + steps}, r["held"]
    for r in memory["fsdp"]:
        assert r["held"] == {"params": total // 2, "grads": total // 2, "optim": total + steps,
                             "total": 2 * total + steps}, r["held"]
    ratio = max(r["held"]["total"] for r in memory["fsdp"]) / max(r["held"]["total"] for r in memory["ddp"])
    assert ratio <= 0.55, ratio
    # The same model, data and optimizer: the same loss.
    assert memory["fsdp"][0]["loss"] == pytest.approx(memory["ddp"][0]["loss"], rel=1e-5)
    for kind in fsdp.ENGINES:
        for r in memory[kind]:
            assert r["step_peak_live_bytes"] >= r["held"]["total"] and r["peak_bytes"] > 0


def _dp(comm_result, label):
    counted = comm_result["counts"][label]
    return counted, fsdp.dp_engine_collectives(counted, label.split(" ")[0]), counted["expected"]


@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp_gathers_each_unit_twice_per_micro_batch_and_reduce_scatters_once_per_step(comm, param_bytes, accum):
    total, _ = param_bytes
    counted, dp, expected = _dp(comm[0], f"fsdp accum={accum}")
    # Units with trainable parameters: each block, and the tied embedding/head with the final norm;
    # the root keeps nothing. Each reshards after forward, so each is gathered again for backward.
    units = SHAPE["layers"] + 1
    assert expected["units"] == expected["units_resharded_after_forward"] == units
    assert expected["padded_param_bytes"] == expected["param_bytes"] == total  # nothing padded here
    assert dp["reduce_scatter"] == [units, total]  # once per step whatever grad_accum: every gradient once
    assert dp["all_gather"] == [accum * 2 * units, accum * 2 * total]
    assert dp["all_gather"] == [accum * expected["gathers_per_micro_batch"], accum * expected["gather_bytes_per_micro_batch"]]
    # FSDP issues nothing else, and nothing reduces gradients over DP besides it.
    assert {key for key in counted["by"] if key.endswith(" fsdp")} == {"all_gather dp fsdp", "reduce_scatter dp fsdp"}
    assert fsdp._calls_bytes(counted, "all_reduce", "dp", "other") == (0, 0)


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_all_reduces_every_gradient_byte_once_per_step(comm, param_bytes, accum):
    total, _ = param_bytes
    counted, dp, expected = _dp(comm[0], f"ddp accum={accum}")
    calls, nbytes = dp["all_reduce"]
    assert nbytes == expected["grad_bytes"] == total
    assert calls >= 1 and calls == _dp(comm[0], "ddp accum=1")[1]["all_reduce"][0]  # buckets: once per step
    assert not any(key.split(" ")[0] in ("all_gather", "reduce_scatter") and key.split(" ")[1] == "dp"
                   for key in counted["by"])


@pytest.mark.parametrize("label", ["ddp accum=1", "ddp accum=2", "fsdp accum=1", "fsdp accum=2"])
def test_counter_agrees_with_bigdense_own_count(comm, label):
    """The dispatch-mode counter attributes to bigdense exactly what `bd.count_collectives` counts."""
    for rank in comm:
        counted = rank["counts"][label]
        assert fsdp.bigdense_collectives(counted, by="kind") == counted["bigdense"], (label, counted)


@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp_leaves_the_tp_collectives_as_they_were_but_the_norms(comm, accum):
    """The layers' TP collectives are the same; the gradient norm's TP all-reduce (one fp32 scalar)
    is gone under FSDP, whose every gradient term is summed in the one all-reduce over the mesh."""
    ddp = fsdp.bigdense_collectives(comm[0]["counts"][f"ddp accum={accum}"])
    ours = fsdp.bigdense_collectives(comm[0]["counts"][f"fsdp accum={accum}"])
    # Over DP: the step's count of targets (one int64, before the first forward: the loss's token
    # weighting) and the report (the loss, and the fused loss's tokens, correct ones and z-loss: 4 fp32).
    assert ours["tp"] == [ddp["tp"][0] - 1, ddp["tp"][1] - 4] and ours["dp"] == ddp["dp"] == [2, 8 + 16]


def _plain_collectives():
    import torch
    import torch.distributed as dist

    from bigdense.testing.counters import CollectiveCounter

    with CollectiveCounter() as counter:
        dist.all_reduce(torch.ones(10))
        dist.all_gather_single(torch.empty(2 * 6), torch.ones(6))
        dist.reduce_scatter_single(torch.empty(3, dtype=torch.float64), torch.ones(2 * 3, dtype=torch.float64))
        dist.broadcast(torch.ones(5, dtype=torch.int32), src=0)
    return counter.records


def test_collective_counter_counts_each_call_at_its_full_size():
    records = run_ranks(_plain_collectives, 2)[0]
    assert records == [("all_reduce", "world", "other", 40), ("all_gather", "world", "other", 48),
                       ("reduce_scatter", "world", "other", 48), ("broadcast", "world", "other", 20)]
