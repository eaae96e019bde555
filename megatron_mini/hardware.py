"""What the accelerators can do: dense peak TFLOP/s per dtype and memory of known GPUs.

One table serves the console's MFU (model FLOPs / peak) and the layout planner. Peaks are the
vendors' dense (no sparsity) tensor-core figures from the data sheets:
    A100 SXM/PCIe   bf16/fp16 312, tf32 156, fp32 19.5    (NVIDIA A100 data sheet)
    H100 SXM        bf16/fp16 989.4, tf32 494.7, fp32 66.9 (NVIDIA H100 data sheet, SXM5)
    H100 PCIe       bf16/fp16 756.5, tf32 378, fp32 51.2
    H100 NVL        bf16/fp16 835.5, tf32 417.5, fp32 60   (NVIDIA H100 NVL data sheet, 94 GB)
    H200 SXM        as H100 SXM, with 141 GB of HBM3e      (NVIDIA H200 data sheet)
    H200 NVL        as H100 NVL, with 141 GB of HBM3e
    GH200           as H100 SXM, with 96 GB of HBM3 (144 GB of HBM3e: "GH200 144G") (NVIDIA GH200 data sheet)
A device name picks the entry whose longest match string it contains ("NVIDIA H200 NVL" is the NVL
card, not the SXM one whose name, "NVIDIA H200", it also contains; "NVIDIA GH200 480GB" is no H200).
`precision.peak_tflops` overrides the table (any other GPU, or a clock-capped one).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    tflops: dict          # dense peak TFLOP/s by "bf16" | "fp16" | "tf32" | "fp32"
    match: tuple = ()     # substrings of torch.cuda.get_device_name() that identify it


GPUS = {
    "a100-80gb": GPU("A100 80GB", 80.0, {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                     ("A100-SXM4-80GB", "A100-SXM-80GB", "A100 80GB", "PG509-210")),   # (older drivers' names)
    "a100-40gb": GPU("A100 40GB", 40.0, {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                     ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB")),
    "h100-80gb": GPU("H100 SXM 80GB", 80.0, {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
                     ("H100 80GB HBM3", "H100 SXM")),
    "h100-pcie": GPU("H100 PCIe 80GB", 80.0, {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
                     ("H100 PCIe",)),
    "h100-nvl": GPU("H100 NVL 94GB", 94.0, {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
                    ("H100 NVL",)),
    "h200": GPU("H200 141GB", 141.0, {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}, ("H200",)),
    "h200-nvl": GPU("H200 NVL 141GB", 141.0, {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
                    ("H200 NVL",)),
    "gh200": GPU("GH200 96GB", 96.0, {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}, ("GH200",)),
    "gh200-144g": GPU("GH200 144GB", 144.0, {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
                      ("GH200 144G",)),
}


def gpu_key(device: torch.device) -> str | None:
    """The GPUS key of a CUDA device (its name contains one of the entry's match strings), else None."""
    return gpu_key_of_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def gpu_key_of_name(name: str) -> str | None:
    """The GPUS key whose longest match string `name` contains, else None."""
    found = [(len(m), k) for k, g in GPUS.items() for m in g.match if m in name]
    return max(found)[1] if found else None


def math_dtype(dtype: str, tf32: bool) -> str:
    """The tensor-core format the matmuls of a run use: fp32 runs on TF32 when allowed."""
    return "tf32" if dtype == "fp32" and tf32 else dtype


def peak_tflops(device: torch.device, dtype: str, tf32: bool, override: float | None = None) -> float | None:
    """Dense peak TFLOP/s of one `device` for matmuls in `dtype` (override if > 0; None or 0: the table's); None when
    unknown (a CPU, or a GPU missing from the table)."""
    return table_peak(gpu_key(device), dtype, tf32, override)


def table_peak(key: str | None, dtype: str, tf32: bool, override: float | None = None) -> float | None:
    """Dense peak TFLOP/s of the GPUS entry `key` for matmuls in `dtype` (override if > 0; None: no entry)."""
    if override is not None and override > 0:
        return override
    return GPUS[key].tflops[math_dtype(dtype, tf32)] if key else None


def set_tf32(enabled: bool) -> bool:
    """Let fp32 matmuls on CUDA run on TF32 tensor cores (or not); returns whether they did before.
    Through torch.set_float32_matmul_precision ("high" / "highest"), which sets every backend's setting
    together: newer torch raises when any of its readers (get_float32_matmul_precision, the legacy
    `matmul.allow_tf32`; inductor's max-autotune reads them) finds one backend set alone by the new API. It sets
    the CPU's oneDNN matmuls too (TF32 only on CPUs that have it); training calls it on CUDA only."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision == "tf32" if hasattr(matmul, "fp32_precision") else matmul.allow_tf32
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    return before


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
REUSED_BLOCK_BYTES = 1 << 30    # blocks up to this size come from the heap, and go back to it when freed
MMAP_THRESHOLD_MAX_BEFORE_2_35 = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)   # (32 MiB on a 64-bit system)


def reuse_freed_host_memory() -> bool:
    """Have the C library's malloc keep the memory that freed tensors held for the next ones, instead of giving it
    back to the kernel; returns whether it took the setting (glibc: Linux; elsewhere nothing changes).

    glibc serves a block of M_MMAP_THRESHOLD bytes or more (128 KiB, raised as such blocks are freed, up to 32 MiB)
    from a mapping of its own, unmapped when freed, and gives the heap's top back when more than M_TRIM_THRESHOLD of
    it is free: the next tensor of that size is new memory again, which the kernel faults in page by page, zeroed.
    On a CPU each microbatch of the tiny model allocates [tokens, vocab] tensors of 16 MiB (the logits, their
    log-softmax, its gradient): a rank of `make train` took 12K-42K page faults a step, and 9% more CPU time a step
    (0.652 s against 0.600 s, medians of 3 interleaved 30-step runs each on a shared 2-core VM; 2,745 against
    3,244 tokens/s) than with blocks of up to REUSED_BLOCK_BYTES served from the heap and never given back (the heap
    stays at its peak size; the peak RSS did not change). What is computed is the same, to the bit.
    glibc before 2.35 refuses an M_MMAP_THRESHOLD above MMAP_THRESHOLD_MAX_BEFORE_2_35, which is then set; the trim
    threshold is set only after it (alone, it would fix the mmap threshold where it stands, 128 KiB at first, and
    every block past it would be a new mapping: 3.2M page faults in 20 steps of a 1-rank `python train.py`, against
    1.4M with neither set)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):      # (no mallopt: macOS; Windows: CDLL(None) is a TypeError)
        return False
    if not (mallopt(M_MMAP_THRESHOLD, REUSED_BLOCK_BYTES) or mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BEFORE_2_35)):
        return False                                  # (musl: a mallopt that takes nothing)
    return bool(mallopt(M_TRIM_THRESHOLD, REUSED_BLOCK_BYTES))


def configure_device(device: torch.device, tf32: bool = False) -> None:
    """The process-wide settings of computing on `device`, as train.py's ranks have them (training.setup_device) and
    the tools that run a model (generate.py, evaluate.py, the benches' processes): on CUDA, fp32 matmuls on TF32
    tensor cores when `tf32` (set_tf32; False: IEEE fp32, torch's default); on the CPU, the memory of freed tensors
    kept for the next ones (reuse_freed_host_memory)."""
    if device.type == "cuda":
        set_tf32(tf32)
    elif device.type == "cpu":
        reuse_freed_host_memory()


def device_memory_bytes(device: torch.device) -> int | None:
    """All the memory of `device`: a GPU's, or the host's physical memory for the CPU (None where the system does
    not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
