"""The engine's all-reduce per message size (sim.latency.collectives): which algorithm runs."""
import pytest

from sim.latency.collectives import CUSTOM_MAX_BYTES, all_reduce_for, one_shot_below
from sim.latency.profile import load_profile

KIB, MIB = 2**10, 2**20


@pytest.mark.parametrize("tp", [2, 4, 6, 8])
def test_messages_under_8_mib_take_vllms_custom_kernels_on_nvlink(tp):
    group = all_reduce_for(load_profile("h100"), tp)
    assert group.choice(16 * KIB)[0] == "allreduce_oneshot"
    big = one_shot_below(tp)
    expected = "allreduce_oneshot" if tp == 2 else "allreduce_twoshot"
    assert group.choice(min(big, CUSTOM_MAX_BYTES - 16))[0] == expected
    assert group.choice(CUSTOM_MAX_BYTES)[0] in ("allreduce", "allreduce_ll", "allreduce_nvls")


def test_one_shot_switches_at_vllms_sizes():
    assert [one_shot_below(n) for n in (2, 4, 6, 8)] == [CUSTOM_MAX_BYTES, 512 * KIB, 256 * KIB, 256 * KIB]


def test_large_messages_take_nvls_only_where_there_is_nvswitch_3_and_five_gpus():
    assert all_reduce_for(load_profile("h100"), 8).choice(64 * MIB)[0] == "allreduce_nvls"
    assert all_reduce_for(load_profile("b200"), 8).choice(64 * MIB)[0] == "allreduce_nvls"
    assert all_reduce_for(load_profile("h100"), 4).choice(64 * MIB)[0] == "allreduce"  # NCCL keeps the ring
    assert all_reduce_for(load_profile("a100_80g"), 8).choice(64 * MIB)[0] == "allreduce"  # NVSwitch 2: no NVLS


def test_pcie_has_no_custom_kernel_and_small_messages_take_nccl_ll():
    group = all_reduce_for(load_profile("l40s"), 2)
    assert group.choice(16 * KIB)[0] == "allreduce_ll"
    assert "allreduce_oneshot" not in group.ops and "allreduce_nvls" not in group.ops


@pytest.mark.parametrize("gpu", ["h100", "a100_80g", "l40s", "b200", "mi300x"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_all_reduce_time_never_falls_as_the_message_grows_within_an_algorithm(gpu, tp):
    group = all_reduce_for(load_profile(gpu), tp)
    sizes = [2**k for k in range(10, 31)]
    for name in group.ops:
        times = [group._time(name, s) for s in sizes]
        assert times == sorted(times)
    # and the chosen time is never above NCCL's best (the engine only switches to faster kernels
    # where vLLM's measured ones are faster: at small sizes)
    nccl = [min(group._time(n, s) for n in group.ops if not n.endswith("shot")) for s in sizes[:8]]
    assert all(group.time(s) <= t for s, t in zip(sizes[:8], nccl))
