"""``trainer.cuda_graphs``: its refusals (on every device), and `StepGraph`'s host-side logic on
CPU with CUDA's graph API replaced by a stand-in whose replay re-runs what was recorded into the
recorded outputs, as a replay rewrites them in place. What a real capture does on a GPU is
measured by ``python -m bigdense.bench.gpu`` (docs/performance.md)."""
import contextlib

import pytest
import torch

from bigdense.errors import ConfigError
from bigdense.train import cuda_graphs
from bigdense.train.cuda_graphs import WARMUP_STEPS, StepGraph, check_cuda_graphs


@pytest.mark.parametrize("kwargs,reason", [
    (dict(device_type="cpu"), "CUDA graphs record GPU kernels; this run is on cpu"),
    (dict(device_type="cuda", engine="deepspeed"), "engine.kind=deepspeed"),
    (dict(device_type="cuda", engine="fsdp"), "engine.kind=fsdp"),
    (dict(device_type="cuda", world_size=2), "escape the process group's deadline"),
    (dict(device_type="cuda", recompute="full"), "use trainer.compile=model"),
    (dict(device_type="cuda", sampled_head=True), "head.sample_rate < 1"),
    (dict(device_type="cuda", pruning=True), "prune.sparsity > 0"),
])
def test_what_cannot_be_recorded_is_refused_with_the_key_and_the_reason(kwargs, reason):
    with pytest.raises(ConfigError, match="trainer.cuda_graphs=true cannot be used here") as err:
        check_cuda_graphs(True, **kwargs)
    assert reason in str(err.value) and "\n" not in str(err.value)


def test_what_can_be_recorded_passes():
    check_cuda_graphs(True, device_type="cuda")
    check_cuda_graphs(True, device_type="cuda", recompute="full", compile_mode="model")
    check_cuda_graphs(False, device_type="cpu", engine="deepspeed", world_size=8)


def test_checks_kept_on_by_the_environment_are_refused(monkeypatch):
    monkeypatch.setenv("BIGDENSE_CHECKS", "1")
    with pytest.raises(ConfigError, match="BIGDENSE_CHECKS=1"):
        check_cuda_graphs(True, device_type="cuda")


def test_the_engine_refuses_it_on_cpu():
    import bigdense as bd
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
    from bigdense.train.engines import EngineSettings, build_engine

    ctx = bd.init_parallel(tp=1)
    settings = EngineSettings(engine=EngineConfig(), optim=OptimConfig(), precision=PrecisionConfig(),
                              micro_batch_size=1, max_steps=1, cuda_graphs=True)
    with pytest.raises(ConfigError, match="this run is on cpu"):
        build_engine(torch.nn.Linear(2, 1), ctx, settings)


class _Recorder:
    """CUDA's graph API on CPU: under ``torch.cuda.graph(g)`` the step runs but its effect on
    ``weight`` (when given) is undone (a capture launches nothing); ``g.replay()`` runs it again and
    writes its outputs into the recorded ones. What torch.compile compiled inside each recording
    is kept in ``compiled_while_recording`` (`GraphCounts`: a compilation there would be captured)."""

    def __init__(self, monkeypatch, graph_step, weight=None):
        from bigdense.train.compile import GraphCounts

        recorder = self

        @contextlib.contextmanager
        def record(g, stream=None):
            before = None if weight is None else weight.clone()
            with GraphCounts() as counts:
                yield
            recorder.compiled_while_recording.append(counts.graphs_forward + counts.graphs_backward)
            if weight is not None:
                weight.copy_(before)

        class Graph:
            def replay(self):
                recorder.replays += 1
                fresh = graph_step.step_fn(graph_step.inputs)
                for out, new in zip(graph_step.outputs, (fresh.raw[k] for k in fresh.FIELDS)):
                    out.copy_(new)

        self.replays, self.compiled_while_recording = 0, []
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", record)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())


class _Stream:
    def wait_stream(self, other):
        pass


def test_step_graph_warms_up_eagerly_records_once_then_replays(monkeypatch):
    from bigdense.host_checks import set_checks
    from bigdense.train.engines.base import StepResult

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    state = {"weight": torch.zeros(())}
    calls = []

    def step(micro_batches):  # a "training step": reads the batch, updates a weight in place
        calls.append(micro_batches)
        x, y = micro_batches[0]
        state["weight"].add_(x.sum() - y.sum())
        return StepResult(state["weight"] * 1.0, x.sum(), x.sum() < 0, torch.ones(()), torch.ones(()))

    graph = StepGraph(step, lambda: (state["weight"].data_ptr(),), torch.device("cpu"))
    recorder = _Recorder(monkeypatch, graph, state["weight"])
    batch = lambda v: [(torch.full((2,), float(v)), torch.zeros(2))]  # noqa: E731
    with set_checks(True):  # the loop's checked steps read the device: eager, and no warm-up
        losses = [graph.step(batch(10)).loss]
    with set_checks(False):
        losses += [graph.step(batch(v)).loss for v in range(1, WARMUP_STEPS + 1)]
        assert graph.graph is None and len(calls) == 1 + WARMUP_STEPS  # warm-up: eager
        losses += [graph.step(batch(v)).loss for v in (5, 7)]
    # Recorded once (its own call) and replayed for both steps, each on its own batch.
    assert graph.recorded == 1 and recorder.replays == 2
    # Each step adds 2 x its batch value to the weight, once: the recording adds nothing.
    assert losses == [20.0, 22.0, 26.0, 32.0, 42.0, 56.0]

    with set_checks(False), pytest.raises(ValueError, match="trainer.cuda_graphs=true: the step was recorded for"):
        graph.step([(torch.ones(3), torch.zeros(3))])

    state["weight"] = torch.zeros(())  # a checkpoint loaded: a new tensor where the old one was
    with set_checks(False):
        graph.step(batch(1))
    assert graph.recorded == 2


def test_compile_model_in_the_loops_order_compiles_in_a_warm_up_step_never_while_recording(monkeypatch):
    # The loop's order: host checks on for trainer.checked_steps, then off (`StepLoop` switches
    # them). The checked steps run the eager forward (`compile_model`), so the compiled one is
    # first called at the first checks-off step: a warm-up step, before the recording, which
    # must compile nothing (inside a real capture a compilation is recorded as what it launched).
    from types import SimpleNamespace

    import bigdense as bd
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
    from bigdense.host_checks import set_checks
    from bigdense.jobs.loop import StepLoop
    from bigdense.models.gpt import GPT, GPTConfig
    from bigdense.train.compile import GraphCounts, apply_compile
    from bigdense.train.engines import EngineSettings, build_engine

    monkeypatch.delenv("BIGDENSE_CHECKS", raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    ctx = bd.init_parallel(tp=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, d_model=16, n_layers=1, n_heads=2, max_seq_len=6, dropout=0.1,
                          head_chunk_size=5))
    torch._dynamo.reset()
    apply_compile(model, "model", "aot_eager", stage="after_recompute")
    settings = EngineSettings(engine=EngineConfig(), optim=OptimConfig(), precision=PrecisionConfig(),
                              micro_batch_size=2, max_steps=10)
    engine = build_engine(model, ctx, settings)
    # What trainer.cuda_graphs=true wraps; no fingerprint, as the stand-in's replay runs the step
    # eagerly, which allocates new gradients (a real replay writes into the recorded ones).
    graph = StepGraph(engine._step, lambda: (), ctx.device)
    recorder = _Recorder(monkeypatch, graph)
    checked = WARMUP_STEPS  # as the defaults have it (10 and 3): enough checked steps to have warmed up
    trainer = SimpleNamespace(max_steps=checked + WARMUP_STEPS + 2, checked_steps=checked, max_bad_steps=1,
                              log_interval=100, eval_interval=0, save_interval=0)
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(0))
    compiled, recorded_at = [], []
    with set_checks(True):  # restores the switch the loop flips
        for step in StepLoop(trainer, None, 0, 0, None):
            with GraphCounts() as counts:
                graph.step([(idx, idx.roll(-1, dims=1))])
            compiled.append(counts.graphs_forward + counts.graphs_backward)
            recorded_at += [step.number] * (graph.recorded - len(recorded_at))
    assert recorder.compiled_while_recording == [0], recorder.compiled_while_recording
    # The checked steps compile nothing, the first checks-off step compiles forward and backward,
    # the recording follows the warm-up.
    assert compiled == [0] * checked + [2] + [0] * (WARMUP_STEPS + 1), compiled
    assert recorded_at == [checked + WARMUP_STEPS + 1] and recorder.replays == 2


def test_a_loaded_checkpoint_keeps_the_running_optimizers_implementation(tmp_path):
    # A run with trainer.cuda_graphs builds AdamW capturable; resuming it from a checkpoint saved
    # without (or the reverse) must not switch that off, or the next capture fails. What the step
    # computes (lr here) still comes from the checkpoint. (DeepSpeed's optimizers keep theirs the
    # same way: tests/test_deepspeed_world.py resumes a DeepSpeed run through a DDP checkpoint.)
    import bigdense as bd

    bd.init_parallel(tp=1)
    model = torch.nn.Linear(3, 2)
    saved_by = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    model(torch.ones(1, 3)).sum().backward()
    saved_by.step()
    bd.save_checkpoint(tmp_path / "ckpt", model=model, optimizer=saved_by)
    resumed = torch.optim.AdamW(model.parameters(), lr=0.5, capturable=True, foreach=False)
    bd.load_checkpoint(tmp_path / "ckpt", model=model, optimizer=resumed)
    group = resumed.param_groups[0]
    assert (group["capturable"], group["foreach"], group["lr"]) == (True, False, 0.1), group
    assert resumed.state[model.weight]["exp_avg"].shape == (2, 3)
