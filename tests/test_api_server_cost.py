"""An HTTP server in the engine's process (vLLM <= 0.5): its work per running request per step is
on the step's critical path, in every engine path alike."""
import numpy as np
import pytest

from sim.latency.model import BatchShape, LatencyModel
from sim.latency.profile import load_profile
from sim.models import load_model


def _latency(api: float, **kw) -> LatencyModel:
    return LatencyModel(load_model("llama31_8b"), load_profile("h100"), 1, "bf16", (1, 2, 4, 8, 16, 32, 64, 128, 256),
                        api_server_per_seq_s=api, **kw)


@pytest.mark.parametrize("seqs", [1, 64, 256])
def test_each_running_request_adds_the_servers_cost_to_a_synchronous_step(seqs):
    shape = BatchShape(num_decode_seqs=seqs, decode_context_tokens=seqs * 500, num_sampled=seqs)
    plain, served = _latency(0.0, async_output_processing=False), _latency(50e-6, async_output_processing=False)
    assert served.step_time(shape) - plain.step_time(shape) == pytest.approx(50e-6 * seqs)
    assert served.breakdown(shape)["cpu"] - plain.breakdown(shape)["cpu"] == pytest.approx(50e-6 * seqs)
    contexts = np.array([500.0 * seqs, 900.0 * seqs])
    vector = served.decode_step_times(seqs, contexts)
    assert vector[0] == served.step_time(shape)  # the vectorised decode path, bit for bit


def test_an_overlapped_host_hides_the_servers_cost_behind_the_gpu_where_it_is_shorter():
    shape = BatchShape(num_decode_seqs=8, decode_context_tokens=8 * 500, num_sampled=8)
    plain, served = _latency(0.0, async_scheduling=True), _latency(50e-6, async_scheduling=True)
    assert served.step_time(shape) == plain.step_time(shape)  # 0.4 ms of host work under a longer GPU step
