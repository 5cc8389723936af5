"""`python -m bigdense.bench.head --suite accuracy` at toy size: every head trains on the same data,
the margin heads get AdaCos's scale, the JSON rows say what was measured, and sizes the suite
cannot measure are refused."""
import json
import math

import pytest

from bigdense.bench import head


def test_accuracy_suite_writes_one_json_row_per_head(tmp_path, capsys):
    path = tmp_path / "acc.jsonl"
    head.main(["--suite", "accuracy", "--start-method", "fork", "--acc-classes", "40", "--acc-batch", "64", "--steps", "6",
               "--json", str(path)])
    rows = [json.loads(line) for line in open(path)]
    assert [r["head"] for r in rows] == ["nearest true centre", "softmax r=1.0", "softmax r=0.1", "ArcFace r=1.0",
                                         "CosFace r=1.0", "ArcFace r=0.1"]
    assert all(0.0 <= r["top1"] <= 1.0 and r["steps"] == 6 and r["eval"] == "test" for r in rows)
    # 40 centres ~N(0, I) in 64 dims sit ~11 apart; noise 0.6 per dimension never crosses half of that.
    assert rows[0]["top1"] == 1.0
    adacos = math.sqrt(2.0) * math.log(40 - 1)  # AdaCos's fixed scale for C = 40
    for r in rows[1:]:
        assert r["scale"] == (pytest.approx(adacos) if "Face" in r["head"] else None)
        assert r["points_vs_softmax"] == pytest.approx((r["top1"] - rows[1]["top1"]) * 100)
        assert 0.0 <= r["top1_half_way"] <= 1.0 and math.isfinite(r["loss"])
    assert "points vs softmax r=1.0" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--acc-classes", "2"], ["--steps", "1"]])
def test_accuracy_suite_refuses_sizes_it_cannot_measure(flags, capsys):
    with pytest.raises(SystemExit):
        head.main(["--suite", "accuracy", *flags])
    assert "--acc-classes must be at least 3 and --steps at least 2, got" in capsys.readouterr().err


@pytest.mark.slow  # four spawned pairs of ranks, two of them DeepSpeed engines
def test_world_suite_counts_no_head_byte_in_either_engines_dp_collectives(tmp_path):
    path = tmp_path / "world.jsonl"
    classes, features = 2000, 16
    head.main(["--suite", "world", "--start-method", "fork", "--classes", str(classes), "--features", str(features), "--tokens", "64",
               "--iters", "1", "--warmup", "1", "--json", str(path)])
    rows = {(r["engine"], r["shard"]): r for r in map(json.loads, open(path))}
    head_bytes = classes * features * 4
    fc = rows["ddp", "tp"]["fc_param_bytes"]
    # DDP all-reduces every gradient it was not told to ignore: the head's too when TP-sharded.
    assert rows["ddp", "world"]["dp_bytes"] == fc and rows["ddp", "tp"]["dp_bytes"] == fc + head_bytes
    # DeepSpeed ZeRO-1 all-reduces gradients and all-gathers the updated partitions (2x the
    # parameters it holds), plus a few scalars; never the world-sharded head.
    assert 2 * fc <= rows["deepspeed", "world"]["dp_bytes"] < 2 * fc + 64
    assert rows["deepspeed", "tp"]["dp_bytes"] >= 2 * (fc + head_bytes)
    for engine in ("ddp", "deepspeed"):  # the same loss either way (the sharding is exact)
        assert rows[engine, "world"]["loss"] == pytest.approx(rows[engine, "tp"]["loss"], rel=1e-6)


@pytest.mark.slow  # seven spawned pairs of ranks
def test_head_floor_bench_measures_every_mode_and_counts_no_host_sync(tmp_path, capsys):
    from bigdense.bench import head_floor

    path = tmp_path / "floor.jsonl"
    head_floor.main(["--start-method", "fork", "--classes", "3001", "--features", "16", "--tokens", "64", "--iters", "1", "--warmup", "0",
                     "--json", str(path)])
    rows = {r["mode"]: r for r in map(json.loads, open(path))}
    assert list(rows) == list(head_floor.MODES)
    for mode in ("tp", "world", "sampled", "sampled-step"):
        assert rows[mode]["syncs_per_call"] == 0, rows[mode]["sync_ops"]  # checks off: nothing read on the host
    # Each mode against its own floor: the exact heads against all their classes, the sampled
    # heads (and Partial FC) against the classes a sample scores on each rank.
    assert rows["tp"]["x_floor"] == pytest.approx(rows["tp"]["median_s"] / rows["floor"]["median_s"])
    assert rows["partial-fc"]["x_floor"] == pytest.approx(
        rows["partial-fc"]["median_s"] / rows["floor-sampled"]["median_s"])
    assert rows["floor"]["floor_rows"] == [1501, 1500]
    assert all(0 < n < 1501 for n in rows["floor-sampled"]["floor_rows"])
    assert all(math.isfinite(rows[m]["loss"]) for m in ("tp", "world", "sampled", "partial-fc"))
    assert "world / tp" in capsys.readouterr().out


def test_head_floor_bench_measures_a_chunks_gemms_by_token_count(tmp_path):
    from bigdense.bench import head_floor

    path = tmp_path / "gemms.jsonl"
    head_floor.main(["--classes", "2000", "--features", "16", "--chunk-gemms", "8", "64", "--json", str(path)])
    rows = [json.loads(line) for line in open(path)]
    assert [r["tokens"] for r in rows] == [8, 64]
    for r in rows:
        assert set(r["gflops"]) == {"logits W h^T", "grad h z^T W", "grad W += z h"}
        assert all(v > 0 for v in r["gflops"].values())


def test_head_floor_bench_times_each_pass_over_a_chunk(tmp_path, capsys):
    from bigdense.bench import head_floor
    from bigdense.layers.head.ce_chunks import auto_chunk_size

    path = tmp_path / "passes.jsonl"
    head_floor.main(["--classes", "2000", "--features", "16", "--chunk-passes", "--json", str(path)])
    (row,) = [json.loads(line) for line in open(path)]
    assert row["tokens"] == auto_chunk_size(1000, "cpu")  # the loss's own chunk for a rank's 1,000 classes
    assert set(row["ns_per_logit"]) == {"GEMM logits", "GEMM grad h", "GEMM grad W", "max", "shift", "floor",
                                        "exp", "sum"}
    assert all(v > 0 for v in row["ns_per_logit"].values())
    assert "of the GEMMs'" in capsys.readouterr().out


def test_gpu_proxy_holds_the_head_within_its_gpu_budget(tmp_path):
    # The GPU path traced on meta at the three LLM shapes of docs/performance.md: at most 6 launches
    # per chunk (3 GEMMs, 2 kernels), at most 20 non-GEMM bytes per logit, and the peak with the bf16
    # gradients under 1.3 / 1.4 / 1.3 GiB. Counts and bytes, not times: exact on any machine.
    path = tmp_path / "proxy.jsonl"
    head.main(["--gpu-proxy", "--json", str(path)])
    rows = [json.loads(line) for line in open(path)]
    assert [(r["tokens"], r["d"], r["classes"]) for r in rows] == [(8192, 4096, 128256), (8192, 2304, 256000),
                                                                      (16384, 4096, 128256)]
    for r, peak in zip(rows, (1.3, 1.4, 1.3)):
        assert r["chunks"] > 1 and r["ops_per_chunk"] <= 6, r
        assert r["nongemm_bytes_per_logit"] <= 20 and r["peak_gib"] <= peak, r


def test_gpu_proxy_chunk_cost_does_not_grow_with_the_classes():
    # No loop over blocks of classes: a chunk launches as many kernels at 32k classes as at 256k.
    from bigdense.bench import head_proxy

    small = head_proxy.measure(4096, 1024, 32_000)
    large = head_proxy.measure(4096, 1024, 256_000)
    assert small.chunks > 1 and large.chunks > 1
    assert small.ops_per_chunk == large.ops_per_chunk <= 6


def test_gpu_proxy_of_the_cpu_shaped_loop_shows_what_it_replaces():
    # The loop the GPU ran before: its per-chunk launches grow with the classes (blocks of
    # weight-gradient rows), and its peak holds the fp32 weight gradient and its bf16 cast -- the
    # 3.12 GiB an H200 measured at this shape (shared/gpu notes, 2026-12-04).
    from bigdense.bench import head_proxy

    old = head_proxy.measure(8192, 4096, 128256, path="off")
    assert old.ops_per_chunk > 100 and old.nongemm_bytes_per_logit > 100
    assert abs(old.peak_gib - 3.12) < 0.01


def test_grad_accuracy_of_the_bf16_gpu_path_against_float64():
    # Toy size (two chunks): both weight-gradient options within a few bf16 ulps (2^-8 = 3.9e-3
    # relative) of float64, fp32 accumulation no worse than bf16, and neither better than the bf16
    # rounding of the exact gradient itself.
    from bigdense.bench import head_grad_accuracy

    r = head_grad_accuracy.measure(1280, 64, 128256, 48)
    assert r["chunks"] == 2
    assert r["fp32_grad_w"] <= r["bf16_grad_w"] < 4 * 2**-8
    assert r["bf16_rounding_grad_w"] <= r["fp32_grad_w"] and r["bf16_grad_h"] < 4 * 2**-8
    assert r["bf16_loss"] < 1e-3
