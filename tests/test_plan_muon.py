"""The memory planner with ``optim.name=muon`` (`bigdense.plan.muon`, `bigdense.plan.muon_step`)
against real steps of the job's own model and engine at tp=2 x dp=2 (gloo CPU processes).

The shapes are uneven on purpose: TP splits the MLP's 151 rows 76 / 75 (the down projection's
columns alike) and the 301-entry vocabulary 151 / 150; FSDP chunks odd row counts (a TP rank's 81
qkv rows 41 / 40, its 75 or 76 MLP rows) and the fused qkv's q, k and v are each a matrix of their
own, interleaved head by head. So every rank sends, keeps and computes something different.

Exact, on every rank: the bytes the Muon exchange sends in a step (``count_collectives``, kind
``all_to_all``: the planner's figure is computed by the optimizer's own `Exchange`, from geometries
built out of the planner's parameter entries) and the number of all-to-alls; the optimizer state
(momentum buffers, AdamW's moments; local tensors, FSDP's unpadded chunks); which rank
orthogonalises which matrix -- each exactly once per step across ranks -- and so the Newton-Schulz
FLOPs per rank. The step's transient (what ``optimizer.step()`` allocates beyond the state it
starts with, live tensor bytes, the least of 3) within 0.5%: the planner leaves out scalars and
index vectors (a few KB at most here). The whole step's peak, set by the optimizer step at this
size, within the planner's 0.5% (`tests/test_plan.py`'s ``PEAK_TOL``).
"""
import pytest
import torch
from omegaconf import OmegaConf

from bigdense.config import ConfigError, PlanConfig
from bigdense.plan.__main__ import DEFAULT_CONF, compose, main
from bigdense.plan.config import estimate_config
from bigdense.plan.measure import measure_config
from bigdense.testing import run_ranks

PEAK_TOL = 0.005
UNEVEN = ["model=gpt_tiny", "model.d_model=54", "model.n_heads=6", "model.d_hidden=151", "model.n_layers=2",
          "data.vocab_size=301", "optim=muon", "parallel.tp=2", "parallel.dp=2", "data.micro_batch_size=1",
          "data.seq_len=16"]


def _plan(**kw):
    return OmegaConf.merge(OmegaConf.structured(PlanConfig), OmegaConf.create({"device_type": "cpu", **kw}))


def _estimate(overrides):
    return estimate_config(compose(overrides, DEFAULT_CONF), _plan())


def _real_step(overrides):
    """One rank of the job: after a first step, one counted step (all-to-all calls and bytes, the
    matrices this rank orthogonalised, the Newton-Schulz calls), then the optimizer state's bytes
    and the least transient of 3 ``optimizer.step()`` calls (live tensor bytes above the start)."""
    import bigdense as bd
    from bigdense.jobs import build_gpt, parallelize_model
    from bigdense.parallel.sharding import local_tensor
    from bigdense.plan.measure import LiveTensorBytes, optimizer_tensors, train_state_tensors
    from bigdense.muon import newton_schulz

    calls, owned, iterate = [], [], newton_schulz.orthogonalize

    def counted_iteration(*args, **kwargs):
        calls.append(1)
        return iterate(*args, **kwargs)

    newton_schulz.orthogonalize = counted_iteration  # before Muon binds it
    cfg = compose(overrides, DEFAULT_CONF)
    ctx = bd.init_parallel(tp=int(cfg.parallel.tp))
    torch.manual_seed(0)
    engine = parallelize_model(build_gpt(cfg, cfg.data.vocab_size, ctx), ctx, cfg, load_pretrained=False).engine
    opt, vocab, seq = engine.optimizer, cfg.data.vocab_size, cfg.data.seq_len
    run = opt.exchange.run

    def recorded_run(pieces, orthogonalize, deliver):
        def once(m, whole):
            owned.append(m)
            return orthogonalize(m, whole)
        return run(pieces, once, deliver)

    opt.exchange.run = recorded_run
    batch = [(torch.randint(0, vocab, (1, seq)), torch.randint(0, vocab, (1, seq)))]
    engine.train_step(batch)
    owned.clear()
    calls.clear()
    with bd.count_collectives() as counts:
        engine.train_step(batch)
    counted = (counts.calls("all_to_all"), counts.bytes("all_to_all"), list(owned), len(calls))
    state = sum(local_tensor(t).numel() * t.element_size() for t in optimizer_tensors(opt) if t.dim() > 0)
    transient = []
    for _ in range(3):
        with LiveTensorBytes() as live:
            live.track(train_state_tensors(engine.model, opt))
            start = live.current
            opt.step()
        transient.append(live.peak - start)
    return (*counted, state, min(transient))


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
@pytest.mark.parametrize("scheme", ["all_to_all", "gather"])
def test_exchange_state_and_owners_per_rank_are_exact(engine, scheme):
    overrides = UNEVEN + [f"engine={engine}", f"optim.muon_comm={scheme}"]
    muon = _estimate(overrides).muon
    ranks = run_ranks(_real_step, 4, overrides, timeout=300)
    assert len(set(muon.sent_bytes)) > 1 or engine == "ddp"  # uneven: FSDP's ranks send different amounts
    done = []
    for rank, (calls, sent, owned, iterated, state, transient) in enumerate(ranks):
        assert (sent, calls) == (muon.sent_bytes[rank], muon.collectives[scheme]), (rank, sent, calls)
        assert state == muon.state_bytes[rank], (rank, state, muon.state_bytes)
        assert len(owned) == len(set(owned)) == iterated, (rank, owned, iterated)  # no matrix twice, one iteration each
        assert sorted(owned) == [m for m, owner in enumerate(muon.owners) if owner == rank]
        assert abs(transient - muon.step_bytes[rank]) <= PEAK_TOL * transient, (rank, transient, muon.step_bytes)
        done += owned
    assert sorted(done) == list(range(muon.matrices))  # every matrix once across ranks
    # 2 layers of q, k, v, out, up, down; the busiest rank's FLOPs are what it was given
    assert muon.matrices == 12 and sum(muon.ns_flops) == sum(_flops(overrides))
    assert muon.collectives == {"all_to_all": 2 * muon.rounds, "gather": 2 * muon.matrices}


def _flops(overrides):
    from bigdense.muon import ns_flops

    d, hidden = 54, 151
    return [ns_flops(shape, 5) for shape in [(d, d)] * 4 + [(hidden, d), (d, hidden)]] * 2


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_peak_is_muon_optimizer_step(engine):
    overrides = UNEVEN + [f"engine={engine}"]
    est = _estimate(overrides)
    assert est.peak_phase == "optimizer", est.phases
    measured = max(run_ranks(_measure, 4, overrides, timeout=300))  # the estimate is the largest rank's
    assert abs(est.peak_bytes - measured) <= PEAK_TOL * measured, (est.peak_bytes, measured, est.phases)


def _measure(overrides):
    return measure_config(compose(overrides, DEFAULT_CONF))["peak_bytes"]


def test_muon_state_replaces_adamw_moments_of_dense_weights():
    adamw = _estimate([o for o in UNEVEN if o != "optim=muon"] + ["engine=ddp"])
    muon = _estimate(UNEVEN + ["engine=ddp"])
    dense = 2 * (3 * 54 * 54 // 2 + 54 * 54 // 2 + 2 * 76 * 54)  # TP rank 0's qkv, out, up, down elements
    assert adamw.bytes_per_rank["optimizer"] - muon.bytes_per_rank["optimizer"] == 4 * dense
    assert adamw.muon is None and muon.muon.state_bytes[0] == muon.bytes_per_rank["optimizer"]


def test_muon_runs_only_where_the_job_runs_it():
    with pytest.raises(ConfigError, match="muon"):
        _estimate(UNEVEN + ["engine=deepspeed"])


def test_cli_prints_the_exchange(capsys):
    assert main(["model=gpt_small", "optim=muon", "parallel.tp=2", "parallel.dp=2", "precision=bf16"]) == 0
    printed = capsys.readouterr().out
    # 12 layers of q, k, v, out, up, down over 4 ranks: 18 rounds; bf16 on CUDA (the default device)
    assert "(bf16); 36 all-to-alls (all_to_all; gather: 144), 72 matrices in 18 rounds" in printed, printed
    assert "Muon Newton-Schulz FLOPs" in printed and "Muon step transient" in printed
    # The step's transient (about twice the Muon weights here) no longer sets gpt_small's peak at 8 x 1024 tokens
    assert "peak (forward)" in printed
