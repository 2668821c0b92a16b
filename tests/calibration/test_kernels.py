"""Every Triton kernel against its torch reference: tiny shapes on the CPU interpreter (fp16,
fp32, fp8; the interpreter gets bf16 dot products wrong silently, so bf16 runs on GPUs only),
realistic shapes on a GPU (marked gpu). Each check is also run on a deliberately wrong variant of
its kernel (the BUG constexpr) and must fail there, so that it is known to be able to fail."""
import pytest
import torch

from tests.calibration.conftest import DEVICE

from calibration.kernels import contiguous_decode, gemm, kv_copy, mla_decode, paged_decode, prefill, stream

CPU_DTYPES = [torch.float16, torch.float32]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOLERANCE = {torch.float16: 2e-2, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float8_e4m3fn: 5e-2}


def close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    assert torch.allclose(actual.float(), expected.float(), atol=tol, rtol=tol), \
        f"max error {(actual.float() - expected.float()).abs().max().item()}"


def both(check):
    """Run a check on the kernel, then on its mutant, which must fail."""
    check(0)
    with pytest.raises(AssertionError):
        check(1)


def rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_stream_copy_and_triad(dtype):
    x, y = rand(3000, dtype=dtype), rand(3000, dtype=dtype)
    both(lambda bug: close(stream.copy(x, block=512, _bug=bug), stream.reference_copy(x), dtype))
    both(lambda bug: close(stream.triad(x, y, 3.0, block=512, _bug=bug), stream.reference_triad(x, y, 3.0), dtype))


@pytest.mark.parametrize("dtype", [*CPU_DTYPES, torch.float8_e4m3fn])
def test_gemm(dtype):
    a, b = rand(70, 48, dtype=dtype), rand(48, 40, dtype=dtype)
    both(lambda bug: close(gemm.gemm(a, b, block_m=32, block_n=32, block_k=16, _bug=bug),
                           gemm.reference(a, b), dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_kv_block_copy_and_gather(dtype):
    cache = rand(8, 4, 2, 8, dtype=dtype)
    src, dst = torch.tensor([1, 6], dtype=torch.int32, device=DEVICE), torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    both(lambda bug: close(kv_copy.copy_blocks(cache.clone(), src, dst, chunk=16, _bug=bug),
                           kv_copy.reference_copy_blocks(cache, src, dst), dtype))
    table = torch.tensor([5, 2, 7], dtype=torch.int32, device=DEVICE)
    both(lambda bug: close(kv_copy.gather(cache, table, chunk=16, _bug=bug), kv_copy.reference_gather(cache, table), dtype))


def decode_inputs(dtype, batch=3, heads=4, kv_heads=2, head_dim=16, block_size=4, num_blocks=24, max_blocks=6):
    q = rand(batch, heads, head_dim, dtype=dtype)
    k, v = rand(num_blocks, block_size, kv_heads, head_dim, dtype=dtype), rand(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    tables = torch.randperm(num_blocks, device=DEVICE)[: batch * max_blocks].reshape(batch, max_blocks).int()
    lengths = torch.tensor([block_size * max_blocks, 5, 13][:batch], dtype=torch.int32, device=DEVICE)  # ragged
    return q, k, v, tables, lengths


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_gqa_ragged_split_kv(dtype, num_splits):
    args = decode_inputs(dtype)
    both(lambda bug: close(paged_decode.paged_decode(*args, num_splits=num_splits, _bug=bug),
                           paged_decode.reference(*args), dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_contiguous_decode(dtype):
    q = rand(2, 4, 16, dtype=dtype)
    k, v = rand(2, 30, 2, 16, dtype=dtype), rand(2, 30, 2, 16, dtype=dtype)
    lengths = torch.tensor([30, 7], dtype=torch.int32, device=DEVICE)
    both(lambda bug: close(contiguous_decode.contiguous_decode(q, k, v, lengths, tile=8, _bug=bug),
                           contiguous_decode.reference(q, k, v, lengths), dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_mla_decode_latent_plus_rope(dtype):
    latent, rope = 32, 8  # DeepSeek-V3's 512 + 64 on the GPU; tiny here
    q_latent, q_rope = rand(2, 4, latent, dtype=dtype), rand(2, 4, rope, dtype=dtype)
    cache = rand(10, 4, latent + rope, dtype=dtype)
    tables = torch.randperm(10, device=DEVICE)[:8].reshape(2, 4).int()
    lengths = torch.tensor([13, 5], dtype=torch.int32, device=DEVICE)
    both(lambda bug: close(mla_decode.mla_decode(q_latent, q_rope, cache, tables, lengths, _bug=bug),
                           mla_decode.reference(q_latent, q_rope, cache, tables, lengths), dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("cached", [0, 13])
def test_prefill_with_cached_prefix(dtype, cached):
    q = rand(2, 20, 4, 16, dtype=dtype)
    k, v = rand(2, cached + 20, 2, 16, dtype=dtype), rand(2, cached + 20, 2, 16, dtype=dtype)
    both(lambda bug: close(prefill.prefill(q, k, v, _bug=bug), prefill.reference(q, k, v), dtype))


def test_launchers_reject_bad_shapes_and_dtypes():
    with pytest.raises(ValueError):
        gemm.gemm(rand(4, 5), rand(6, 3))
    with pytest.raises(TypeError):
        gemm.gemm(rand(4, 5), rand(5, 3, dtype=torch.float32))
    q, k, v, tables, lengths = decode_inputs(torch.float16)
    with pytest.raises(TypeError):
        paged_decode.paged_decode(q, k, v, tables.long(), lengths)
    with pytest.raises(ValueError):
        paged_decode.paged_decode(q, k, v, tables, lengths * 100)
    with pytest.raises(ValueError):
        kv_copy.gather(k, torch.tensor([99], dtype=torch.int32, device=DEVICE))


# -- realistic shapes, on a GPU only ----------------------------------------------------------------
@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gemm_and_decode_at_serving_shapes(dtype):
    a, b = rand(512, 4096, dtype=dtype), rand(4096, 6144, dtype=dtype)
    close(gemm.gemm(a, b, block_m=128, block_n=128, block_k=64), gemm.reference(a, b), dtype)
    for block_size in (16, 128):
        args = decode_inputs(dtype, batch=8, heads=32, kv_heads=8, head_dim=128, block_size=block_size,
                             num_blocks=8 * (4096 // block_size), max_blocks=4096 // block_size)
        close(paged_decode.paged_decode(*args, num_splits=4), paged_decode.reference(*args), dtype)


@pytest.mark.gpu
@GPU
def test_gpu_mla_and_prefill_at_serving_shapes():
    dtype = torch.bfloat16
    q_latent, q_rope = rand(4, 16, 512, dtype=dtype), rand(4, 16, 64, dtype=dtype)
    cache = rand(4 * 64, 64, 576, dtype=dtype)
    tables = torch.arange(4 * 64, device=DEVICE).reshape(4, 64).int()
    lengths = torch.tensor([4096, 100, 2000, 64], dtype=torch.int32, device=DEVICE)
    close(mla_decode.mla_decode(q_latent, q_rope, cache, tables, lengths),
          mla_decode.reference(q_latent, q_rope, cache, tables, lengths), dtype)
    q = rand(1, 512, 32, 128, dtype=dtype)
    k, v = rand(1, 2048 + 512, 8, 128, dtype=dtype), rand(1, 2048 + 512, 8, 128, dtype=dtype)
    close(prefill.prefill(q, k, v, block_q=64, block_k=64), prefill.reference(q, k, v), dtype)
