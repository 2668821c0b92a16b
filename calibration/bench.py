"""The benchmark harness: shape grids from Hydra config (scenarios/grid/), timed with
`triton.testing.do_bench` (quantiles 0.2 / 0.5 / 0.8), one long-format row per measurement
(calibration/raw.py), then the fit. Also host-device copy bandwidth (pinned and pageable), kernel
launch overhead, and all-reduce timings when several GPUs are visible.

    python -m calibration run [grid=quick|full] [name=<gpu>]
"""
from __future__ import annotations

import itertools
import sys
import time
from datetime import datetime, timezone
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from calibration.gpus import profile_name
from sim.errors import KvsimError

QUANTILES = (0.2, 0.5, 0.8)
def expand(grid: dict) -> list[tuple[str, dict]]:
    """(op, shape) for every point of every op's cartesian product, in config order."""
    points = []
    for op, axes in grid.items():
        keys = list(axes)
        for values in itertools.product(*(axes[k] for k in keys)):
            shape = dict(zip(keys, values))
            if "nk" in shape:
                shape["n"], shape["k"] = shape.pop("nk")
            points.append((op, shape))
    return points


def _torch_dtype(torch, name: str):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
            "fp8": torch.float8_e4m3fn}[name]


def make_case(op: str, shape: dict, device: str, backend: str = "triton") -> tuple[Callable[[], object], dict]:
    """A closure that runs the op once on prepared inputs (our Triton kernel, or with
    backend=torch the kernel's torch reference), and the row's shape columns."""
    import torch

    from calibration.kernels import contiguous_decode, gemm, kv_copy, mla_decode, paged_decode, prefill, stream

    dtype = _torch_dtype(torch, shape.get("dtype", "bf16"))
    row = dict(shape)

    def rand(*size, dt=dtype):
        return torch.randn(*size, device=device).to(dt)

    torch_ops = backend == "torch"
    if op == "gemm":
        a, b = rand(shape["m"], shape["k"]), rand(shape["k"], shape["n"])
        return (lambda: (gemm.reference if torch_ops else gemm.gemm)(a, b)), row
    if op in ("paged_decode", "mla_decode"):
        batch, context, block = shape["batch"], shape["context"], shape["block_size"]
        per_seq = -(-context // block)
        tables = torch.arange(batch * per_seq, device=device, dtype=torch.int32).reshape(batch, per_seq)
        lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        if op == "mla_decode":
            cache = rand(batch * per_seq, block, 576)
            q_lat, q_rope = rand(batch, shape["heads"], 512), rand(batch, shape["heads"], 64)
            run = mla_decode.reference if torch_ops else mla_decode.mla_decode
            return (lambda: run(q_lat, q_rope, cache, tables, lengths)), row
        k = rand(batch * per_seq, block, shape["kv_heads"], shape["head_dim"])
        v = torch.empty_like(k).copy_(k)
        q = rand(batch, shape["heads"], shape["head_dim"])
        if torch_ops:
            return (lambda: paged_decode.reference(q, k, v, tables, lengths)), row
        return (lambda: paged_decode.paged_decode(q, k, v, tables, lengths, shape.get("num_splits", 1))), row
    if op == "contiguous_decode":
        k = rand(shape["batch"], shape["context"], shape["kv_heads"], shape["head_dim"])
        v = torch.empty_like(k).copy_(k)
        q = rand(shape["batch"], shape["heads"], shape["head_dim"])
        lengths = torch.full((shape["batch"],), shape["context"], dtype=torch.int32, device=device)
        run = contiguous_decode.reference if torch_ops else contiguous_decode.contiguous_decode
        return (lambda: run(q, k, v, lengths)), row
    if op == "prefill":
        total = shape["context"] + shape["num_tokens"]
        q = rand(shape["batch"], shape["num_tokens"], shape["heads"], shape["head_dim"])
        k = rand(shape["batch"], total, shape["kv_heads"], shape["head_dim"])
        v = torch.empty_like(k).copy_(k)
        if torch_ops:
            return (lambda: prefill.reference(q, k, v)), row
        return (lambda: prefill.prefill(q, k, v, block_q=64, block_k=64)), row
    if op == "kv_copy":
        cache = rand(2 * shape["num_blocks"], shape["block_size"], shape["kv_heads"], shape["head_dim"])
        src = torch.arange(shape["num_blocks"], device=device, dtype=torch.int32)
        dst = src + shape["num_blocks"]
        row["bytes"] = 2 * cache[: shape["num_blocks"]].numel() * cache.element_size()
        run = kv_copy.reference_copy_blocks if torch_ops else kv_copy.copy_blocks
        return (lambda: run(cache, src, dst)), row
    if op == "stream":
        numel = int(shape["bytes"]) // (2 * torch.tensor([], dtype=dtype).element_size())
        x, y = rand(numel), rand(numel)
        row["bytes"] = stream.bytes_moved(shape["kind"], numel, x.element_size())
        copy, triad = (stream.reference_copy, stream.reference_triad) if torch_ops else (stream.copy, stream.triad)
        return ((lambda: copy(x)) if shape["kind"] == "copy" else (lambda: triad(x, y, 2.0))), row
    if op == "host_copy":
        numel = int(shape["bytes"]) // 2
        host = torch.empty(numel, dtype=dtype, pin_memory=bool(shape["pinned"]))
        dev = torch.empty(numel, dtype=dtype, device=device)
        row["bytes"] = numel * 2
        return (lambda: dev.copy_(host, non_blocking=bool(shape["pinned"]))), row
    raise KvsimError(f"unknown op '{op}' in the grid, key grid, use gemm, paged_decode, contiguous_decode, "
                     f"mla_decode, prefill, kv_copy, stream or host_copy")


def do_bench_timer(fn, warmup_ms: int, rep_ms: int) -> tuple[float, float, float]:
    from triton.testing import do_bench
    return tuple(t / 1e3 for t in do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES)))


def wall_clock_timer(fn, warmup_ms: int, rep_ms: int, repeats: int = 5) -> tuple[float, float, float]:
    """For dry runs on the CPU (do_bench needs a GPU): quantiles of a few timed calls."""
    import numpy as np
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return tuple(float(q) for q in np.quantile(times, QUANTILES))


def launch_overhead_row(device: str, timer, warmup_ms: int, rep_ms: int) -> dict:
    import torch
    x = torch.empty(1, device=device)
    p20, p50, p80 = timer(lambda: x.add_(0), warmup_ms, rep_ms)
    return {"op": "launch", "dtype": "fp32", "time_s": p50, "time_s_p20": p20, "time_s_p80": p80}


def benchmark(points, *, device: str, context: dict, timer=do_bench_timer, warmup_ms: int = 25,
              rep_ms: int = 100, progress=sys.stderr, backend: str = "triton") -> list[dict]:
    rows, started = [], time.perf_counter()
    drawing = hasattr(progress, "isatty") and progress.isatty()  # a bar on a terminal, one line otherwise
    for index, (op, shape) in enumerate(points, start=1):
        fn, row = make_case(op, shape, device, backend)
        p20, p50, p80 = timer(fn, warmup_ms, rep_ms)
        rows.append({**row, "op": op, "time_s": p50, "time_s_p20": p20, "time_s_p80": p80, **context})
        if drawing:
            elapsed = time.perf_counter() - started
            eta = elapsed / index * (len(points) - index)
            bar = "#" * (30 * index // len(points))
            print(f"\r[{bar:<30}] {index}/{len(points)} {op:<17} eta {eta:5.0f}s", end="", file=progress, flush=True)
    print("" if drawing else f"measured {len(points)} shapes in {time.perf_counter() - started:.1f} s", file=progress)
    rows.append({**launch_overhead_row(device, timer, warmup_ms, rep_ms), **context})
    return rows


def allreduce_rows(sizes: list[int], context: dict) -> list[dict]:
    """NCCL all-reduce over every visible GPU, one process per GPU (several GPUs only)."""
    import torch
    import torch.multiprocessing as mp
    world = torch.cuda.device_count()
    if world < 2:
        return []
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_allreduce_worker, args=(world, sizes, queue), nprocs=world, join=True)
    return [{**queue.get(), **context} for _ in sizes]


def _allreduce_worker(rank: int, world: int, sizes: list[int], queue) -> None:
    import torch
    import torch.distributed as dist
    from triton.testing import do_bench
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    for size in sizes:
        x = torch.empty(size // 2, dtype=torch.bfloat16, device="cuda")
        p20, p50, p80 = (t / 1e3 for t in do_bench(lambda: dist.all_reduce(x), quantiles=list(QUANTILES)))
        if rank == 0:
            queue.put({"op": "allreduce", "bytes": size, "tp": world, "dtype": "bf16",
                       "time_s": p50, "time_s_p20": p20, "time_s_p80": p80})
    dist.destroy_process_group()


def gpu_context(device: str = "cuda", backend: str = "triton") -> dict:
    import torch
    import triton
    if backend not in ("triton", "torch"):
        raise KvsimError(f"unknown backend '{backend}', key backend, use triton or torch")
    if device == "cpu" and backend == "torch":
        return {"gpu": f"CPU {cpu_name()}", "torch": torch.__version__, "triton": triton.__version__,
                "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "source": "measured"}
    if device == "cpu":
        import os
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise KvsimError("device=cpu needs TRITON_INTERPRET=1 set before Python starts, command line, "
                             "run TRITON_INTERPRET=1 python -m calibration run device=cpu grid=smoke")
        return {"gpu": "CPU (Triton interpreter, dry run)", "torch": torch.__version__, "triton": triton.__version__,
                "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "source": "dry-run"}
    if device != "cuda":
        raise KvsimError(f"unknown device '{device}', key device, use cuda or cpu")
    if not torch.cuda.is_available():
        raise KvsimError("no CUDA GPU found, python -m calibration run, run it on a machine with a GPU "
                         "(or refit measurements with python -m calibration fit raw=FILE name=<gpu>)")
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "driver": _driver_version(), "torch": torch.__version__,
            "triton": triton.__version__, "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source": "measured"}


def run_task(cfg: DictConfig) -> None:
    """Detect the GPU, benchmark the grid, fit, write raw.csv, profile.json and the report."""
    import pandas as pd

    from calibration.commands import _fit_and_write

    require_torch_and_triton()
    context = gpu_context(cfg.device, cfg.backend)
    measured_cpu = cfg.device == "cpu" and cfg.backend == "torch"
    default = "cpu" if measured_cpu else "dry_run" if cfg.device == "cpu" else profile_name(context["gpu"])
    name = cfg.name or default
    points = expand(OmegaConf.to_container(cfg.grid, resolve=True))
    print(f"calibrating {context['gpu']} as '{name}': {len(points)} measurements", file=sys.stderr)
    timer = wall_clock_timer if cfg.device == "cpu" else do_bench_timer
    rows = benchmark(points, device=cfg.device, context=context, timer=timer, warmup_ms=cfg.warmup_ms,
                     rep_ms=cfg.rep_ms, backend=cfg.backend)
    if cfg.device == "cuda":
        rows += allreduce_rows([1 << 20, 1 << 24, 1 << 28], context)
    frame = pd.DataFrame(rows)
    base = measured_ceilings(frame, name, context["gpu"]) if measured_cpu else None
    fit_cfg = OmegaConf.create({"name": name, "base": None if measured_cpu else _base_for(name),
                                "out_dir": cfg.out_dir})
    _fit_and_write(frame, fit_cfg, context["source"], origin=f"python -m calibration run on {context['gpu']}"
                   + (" (torch reference operators)" if cfg.backend == "torch" else ""), raw_rows=rows,
                   base=base)


def require_torch_and_triton() -> None:
    """`run` times Triton kernels: without torch or triton, one line saying what to install."""
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        raise KvsimError(f"python -m calibration run needs torch and triton ({exc.name} is not "
                         f"installed), command line, install them first: pip install torch==2.13.0 "
                         f"triton==3.7.1 (fit, import-vidur, predict and show need neither)") from None


def _driver_version() -> str:
    try:
        import pynvml
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - NVML is optional; the CUDA runtime version is the fallback
        import torch
        return f"cuda {torch.version.cuda}"


def _base_for(name: str) -> str:
    from sim.latency.profile import available_profiles
    return name if name in available_profiles() else "h100"


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), else what platform says."""
    import platform
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measured_ceilings(frame, name: str, device_name: str) -> dict:
    """The base a CPU's fit starts from: no datasheet, so the best GEMM FLOP/s and the best
    stream bandwidth measured stand for the peaks (efficiencies are shares of them) and host
    memory for device memory; every operator's prior is 1.0 of those ceilings."""
    import os

    gemm, stream = frame[frame.op == "gemm"], frame[frame.op == "stream"]
    if gemm.empty or stream.empty:
        raise KvsimError("a CPU calibration needs gemm and stream rows, key grid, use grid=smoke or a grid "
                         "with both")
    flops = float((2.0 * gemm.m * gemm.n * gemm.k / gemm.time_s).max())
    bandwidth = float((stream.bytes / stream.time_s).max())
    unit = {"compute_efficiency": 1.0, "memory_efficiency": 1.0, "t0_s": 0.0,
            "source": "prior:not measured on this CPU (the measured ceilings, no fixed cost)"}
    return {"name": name, "gpu_name": device_name, "source": "measured",
            "reference": "measured ceilings of this CPU (calibration.bench.measured_ceilings)",
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "hbm_bandwidth_bytes_per_s": bandwidth, "bf16_flops_per_s": flops, "fp8_flops_per_s": None,
            "link": "none (one host)", "link_bandwidth_bytes_per_s": bandwidth,
            "host_link_bytes_per_s": bandwidth, "host_link_latency_s": 0.0, "step_overhead_s": 0.0,
            "operators": {op: dict(unit) for op in ("gemm", "attention_prefill", "attention_decode",
                                                    "allreduce", "send_recv", "cpu_step")}}

