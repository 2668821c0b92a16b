"""The host's share of a step: CUDA-graph replay versus eager launches, and the CPU step cost."""
import dataclasses

import numpy as np
import pandas as pd
import pytest

from calibration.fit import fit_op, prepare
from calibration.vidur import import_cpu_overheads
from sim.config import VLLM_CAPTURE_SIZES
from sim.latency import BatchShape, LatencyModel, load_profile
from sim.latency.model import eager_kernels
from sim.models import load_model

from tests.calibration.test_catalogue import DATA
from tests.test_latency import bare


def with_launch(profile, kernel_launch_s, graph_launch_s=20e-6):
    return dataclasses.replace(profile, kernel_launch_s=kernel_launch_s, graph_launch_s=graph_launch_s)


def decode(n, context=1000):
    return BatchShape(num_decode_seqs=n, decode_context_tokens=n * context, num_sampled=n)


def models(profile, model="llama31_8b", tp=1):
    spec = load_model(model)
    return (LatencyModel(spec, profile, tp, "bf16", VLLM_CAPTURE_SIZES),
            LatencyModel(spec, profile, tp, "bf16", ()))


def gpu_part(times):
    return sum(v for k, v in times.items() if k not in ("launch", "cpu", "cpu_output"))


def test_graph_replay_pays_one_launch_and_eager_pays_what_the_gpu_does_not_hide():
    profile = with_launch(load_profile("h100"), kernel_launch_s=10e-6)
    graph, eager = models(profile)
    shape = decode(1)
    g, e = graph.breakdown(shape), eager.breakdown(shape)
    assert g["launch"] == profile.graph_launch_s
    kernels = eager_kernels(load_model("llama31_8b"), 1)
    assert kernels == 6 + 32 * (6 + 4)  # per step, then attention and MLP blocks per layer
    assert e["launch"] == pytest.approx(max(0.0, kernels * 10e-6 - gpu_part(e)))
    # Slow launches: the host is the bottleneck of an eager step, which takes the launches' time.
    slow = with_launch(profile, kernel_launch_s=40e-6)
    slow_graph, slow_eager = models(slow)
    assert slow_eager.step_time(shape) == pytest.approx(kernels * 40e-6 + e["cpu"], rel=1e-12)
    assert slow_graph.step_time(shape) == pytest.approx(graph.step_time(shape), rel=1e-12)


def test_a_graph_batch_runs_padded_to_its_capture_size_and_large_or_prefill_batches_run_eagerly():
    graph, eager = models(bare(load_profile("h100")))  # no correction table: every token counts
    three, four = graph.breakdown(decode(3)), graph.breakdown(decode(4))
    assert three["qkv_o_proj"] == four["qkv_o_proj"] and three["mlp"] == four["mlp"]
    assert eager.breakdown(decode(3))["mlp"] < eager.breakdown(decode(4))["mlp"]
    assert graph.graph_size(decode(3)) == 4 and graph.graph_size(decode(513)) == 0
    assert graph.graph_size(decode(512)) == 512 and graph.graph_size(decode(9)) == 16
    assert graph.graph_size(decode(257)) == 272  # by 16 from 256
    prefill = BatchShape(num_prefill_tokens=100, num_prefill_seqs=1, prefill_causal_pairs=5050,
                         prefill_kv_tokens=100, num_sampled=1)
    assert graph.graph_size(prefill) == 0
    assert graph.breakdown(prefill) == eager.breakdown(prefill)


@pytest.mark.parametrize("kernel_launch_s", [0.0, 5e-6, 60e-6])
@pytest.mark.parametrize("num_seqs", [3, 200, 600])
def test_decode_stretch_times_equal_the_step_loop_in_graph_and_eager_regimes(kernel_launch_s, num_seqs):
    profile = with_launch(load_profile("a100_80g"), kernel_launch_s)
    for latency in models(profile, "llama2_70b", 4):
        contexts = np.arange(num_seqs * 300, num_seqs * 300 + num_seqs * 50, num_seqs)
        stepped = [latency.step_time(BatchShape(num_decode_seqs=num_seqs, decode_context_tokens=int(c),
                                                num_sampled=num_seqs)) for c in contexts]
        assert latency.decode_step_times(num_seqs, contexts).tolist() == stepped


def test_the_cpu_step_grows_with_the_batch_by_its_per_sequence_cost():
    profile = load_profile("a100_80g")
    cpu = profile.op("cpu_step")
    assert cpu.per_seq_s > 0
    graph, _ = models(profile)
    assert graph.breakdown(decode(128))["cpu"] - graph.breakdown(decode(8))["cpu"] == pytest.approx(
        120 * cpu.per_seq_s, rel=1e-9)


def test_cpu_step_fit_recovers_known_parameters():
    batch = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256])
    frame = pd.DataFrame({"op": "cpu_step", "batch_size": batch, "time_s": 0.9e-3 + 35e-6 * batch})
    rows = prepare(frame, "cpu_step", {"bf16_flops_per_s": 1e15, "hbm_bandwidth_bytes_per_s": 1e12})
    params = fit_op(rows, {"operators": {"gemm": {"compute_efficiency": 0.7, "memory_efficiency": 0.8,
                                                  "t0_s": 0.0}}}, "cpu_step")
    assert params["t0_s"] == pytest.approx(0.9e-3, rel=1e-6)
    assert params["per_seq_s"] == pytest.approx(35e-6, rel=1e-6)
    assert "correction" not in params  # a straight line extrapolates; a table would hold its edges


def test_vidur_cpu_overheads_split_into_the_critical_step_and_output_processing():
    path = DATA / "vidur_a100_2024_sample" / "cpu_overheads.csv"
    raw = pd.read_csv(path)
    rows = import_cpu_overheads(path, "a100")
    step = [r for r in rows if r["op"] == "cpu_step"]
    output = [r for r in rows if r["op"] == "cpu_output"]
    assert len(step) == len(output) == len(raw)
    first = raw.iloc[0]
    critical = sum(first[f"{p}_median"] for p in ("schedule", "prepare_inputs_e2e", "sampler_e2e"))
    assert step[0]["time_s"] == pytest.approx(critical / 1e3)
    assert output[0]["time_s"] == pytest.approx(first["process_model_outputs_median"] / 1e3)
    assert step[0]["batch_size"] == first["batch_size"]


@pytest.mark.parametrize("num_seqs", [4, 256])
def test_asynchronous_output_processing_hides_behind_the_gpu_and_a_synchronous_engine_pays_it(num_seqs):
    model, profile = load_model("llama31_8b"), load_profile("a100_80g")
    overlapped = LatencyModel(model, profile, 1, "bf16", VLLM_CAPTURE_SIZES, async_output_processing=True)
    serial = LatencyModel(model, profile, 1, "bf16", VLLM_CAPTURE_SIZES, async_output_processing=False)
    shape = decode(num_seqs)
    a, s = overlapped.breakdown(shape), serial.breakdown(shape)
    output = serial.cpu_output_time(num_seqs)
    assert s["cpu_output"] == output > 0
    assert a["cpu_output"] == max(0.0, output - gpu_part(a))
    assert overlapped.step_time(shape) < serial.step_time(shape)
    contexts = np.arange(num_seqs * 500, num_seqs * 500 + num_seqs * 20, num_seqs)
    for latency in (overlapped, serial):
        stepped = [latency.step_time(BatchShape(num_decode_seqs=num_seqs, decode_context_tokens=int(c),
                                                num_sampled=num_seqs)) for c in contexts]
        assert latency.decode_step_times(num_seqs, contexts).tolist() == stepped


@pytest.mark.parametrize("num_seqs", [4, 256, 2048])
def test_async_scheduling_hides_the_whole_host_step_behind_the_gpu_and_pays_only_what_exceeds_it(num_seqs):
    """TensorRT-LLM's and SGLang's overlap schedulers, vLLM's --async-scheduling: the next step is
    scheduled and the last one's outputs processed while the GPU runs, so a step costs
    max(GPU, host) (plus launches), where the host's critical step otherwise adds to it."""
    model, profile = load_model("llama31_8b"), load_profile("h100")
    overlap = LatencyModel(model, profile, 1, "bf16", VLLM_CAPTURE_SIZES, async_scheduling=True)
    plain = LatencyModel(model, profile, 1, "bf16", VLLM_CAPTURE_SIZES)
    shape = decode(num_seqs)
    o, p = overlap.breakdown(shape), plain.breakdown(shape)
    gpu, host = gpu_part(o), plain.cpu_time(num_seqs) + plain.cpu_output_time(num_seqs)
    assert gpu == gpu_part(p)
    assert o["cpu"] == max(0.0, host - gpu) and o["cpu_output"] == 0.0
    assert overlap.step_time(shape) == pytest.approx(gpu + o["launch"] + max(0.0, host - gpu), rel=1e-12)
    assert overlap.step_time(shape) < plain.step_time(shape)
    if num_seqs == 2048:  # short contexts: the host's 75 ms (Sarathi-Serve's per-sequence costs) outlast the GPU
        short = overlap.breakdown(decode(num_seqs, 128))
        assert short["cpu"] == pytest.approx(host - gpu_part(short), rel=1e-12) and short["cpu"] > 0.01
    for context in (500, 64):  # at 64 tokens a sequence the host outlasts the GPU from 2,048 sequences on
        contexts = np.arange(num_seqs * context, num_seqs * context + num_seqs * 20, num_seqs)
        stepped = [overlap.step_time(BatchShape(num_decode_seqs=num_seqs, decode_context_tokens=int(c),
                                                num_sampled=num_seqs)) for c in contexts]
        assert overlap.decode_step_times(num_seqs, contexts).tolist() == stepped


def test_async_scheduling_is_off_with_pipeline_stages_and_says_so(capsys):
    from tests.conftest import compose_config
    from sim.run import prepare
    setup = prepare(compose_config("run", ["+experiment=vidur_matched", "async_scheduling=true"]))
    assert not setup.latency.async_scheduling
    assert "async_scheduling=true has no effect with pipeline_parallel_size > 1" in capsys.readouterr().err
    prepare(compose_config("run", ["+experiment=golden", "async_scheduling=true", "async_output_processing=false"]))
    assert "async_output_processing=false has no effect with async_scheduling=true" in capsys.readouterr().err


def test_the_runs_title_says_async_scheduling_where_it_runs_spelled_as_the_cli_takes_it():
    from sim.report import run_title
    from tests.conftest import compose_config
    assert "async_scheduling" not in run_title(compose_config("run", []))
    assert " async_scheduling=true " in run_title(compose_config("run", ["async_scheduling=true"]))
    pp = compose_config("run", ["async_scheduling=true", "pipeline_parallel_size=2"])
    assert "async_scheduling" not in run_title(pp)  # no effect under pipeline stages (warned)
    assert " enable_expert_parallel=true " in run_title(compose_config("run", ["enable_expert_parallel=true"]))
