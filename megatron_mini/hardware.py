"""What the accelerators can do: dense peak TFLOP/s per dtype and memory of known GPUs.

One table serves the console's MFU (model FLOPs / peak) and the layout planner. Peaks are the
vendors' dense (no sparsity) tensor-core figures from the data sheets:
    A100 SXM/PCIe   bf16/fp16 312, tf32 156, fp32 19.5    (NVIDIA A100 data sheet)
    H100 SXM        bf16/fp16 989.4, tf32 494.7, fp32 66.9 (NVIDIA H100 data sheet, SXM5)
    H100 PCIe       bf16/fp16 756.5, tf32 378, fp32 51.2
    H200            as H100 SXM, with 141 GB of HBM3e
`precision.peak_tflops` overrides the table (any other GPU, or a clock-capped one).
"""
from __future__ import annotations

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
                     ("A100-SXM4-80GB", "A100 80GB")),
    "a100-40gb": GPU("A100 40GB", 40.0, {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                     ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB")),
    "h100-80gb": GPU("H100 SXM 80GB", 80.0, {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
                     ("H100 80GB HBM3", "H100 SXM")),
    "h100-pcie": GPU("H100 PCIe 80GB", 80.0, {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
                     ("H100 PCIe",)),
    "h200": GPU("H200 141GB", 141.0, {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}, ("H200",)),
}


def gpu_key(device: torch.device) -> str | None:
    """The GPUS key of a CUDA device (its name contains one of the entry's match strings), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((k for k, g in GPUS.items() if any(m in name for m in g.match)), None)


def math_dtype(dtype: str, tf32: bool) -> str:
    """The tensor-core format the matmuls of a run use: fp32 runs on TF32 when allowed."""
    return "tf32" if dtype == "fp32" and tf32 else dtype


def peak_tflops(device: torch.device, dtype: str, tf32: bool, override: float = 0.0) -> float | None:
    """Dense peak TFLOP/s of one `device` for matmuls in `dtype` (override if > 0); None when unknown
    (a CPU, or a GPU missing from the table)."""
    if override > 0:
        return override
    key = gpu_key(device)
    return GPUS[key].tflops[math_dtype(dtype, tf32)] if key else None


def set_tf32(enabled: bool) -> bool:
    """Let fp32 matmuls on CUDA run on TF32 tensor cores (or not); returns whether they did before.
    Newer torch has `matmul.fp32_precision`, and once it is set, reading the legacy `allow_tf32` raises,
    so only one of the two APIs is ever used. Convolutions (cuDNN) are left alone: the model has none."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before = matmul.fp32_precision == "tf32"
        matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:
        before = matmul.allow_tf32
        matmul.allow_tf32 = enabled
    return before
