"""Triton kernels with autograd wrappers:

- `megatron_mini.kernels.layernorm`: layer_norm, add_layer_norm (residual add + LayerNorm in one pass each way),
  and torch_add_layer_norm (the eager reference);
- `megatron_mini.kernels.attention`: flash_attention, flash_attention_qkv (causal FlashAttention-2 with dropout;
  the model's attention softmax lives here, never as a standalone kernel), and torch_attention
  (the kernels themselves are in attention_kernels.py);
- `megatron_mini.kernels.cross_entropy`: row_stats, logits_grad (the cross-entropy over a vocabulary shard;
  tensor_parallel.vocab_parallel_cross_entropy(fused=True) wraps them for autograd and TP).

Under torch.compile the model's entry points (layer_norm, add_layer_norm, flash_attention_qkv) call
custom ops (torch.library.custom_op: opaque to dynamo and inductor, a call in the graph, not a break):
dynamo cannot trace the kernels under Triton's interpreter, and tracing their autotuning has not been
tried on a GPU. Eager calls take a plain autograd.Function, whose host cost is about half a custom op's.
flash_attention (separate q, k, v: tests, benches) stays a graph break (`torch.compiler.disable`), and the
cross-entropy's kernels run where the model keeps its fused cross-entropy: eager.

Import the submodules directly; this package imports nothing (no triton) so that CPU-only code
can import it (and ask `interpreting()`). On CPU the kernels run under the Triton interpreter:
set TRITON_INTERPRET=1 before importing a submodule.
"""
import functools
import importlib.util
import inspect
import os
import re

MAX_HEAD_DIM = 128       # the attention's GPU configs are sized for head dims up to 128 (256 overflows shared memory)
MAX_DROPOUT_SEQ = 46340  # the attention's dropout offsets row * s + col must fit in int32
MAX_BATCH_HEADS = 65535  # the attention's launches put b * heads on grid axis 1, which CUDA caps at 65535
HOPPER = 90              # compute capability (10 * major + minor) of the H100, whose dots are wgmma: the GPU the
                         # kernels' configurations were sized on; older GPUs hold more in registers (kernels/*)
# Every launch contracts a * b + c into one FMA, as the kernels were tuned and measured: said, not left to
# Triton's default, which 3.10 turns off (3.9 warns in each process that leaves it unset); the interpreter
# ignores it
FP_FUSION = {"enable_fp_fusion": True}


def attention_unsupported(head_dim: int, seq_len: int, dropout: float, batch_heads: int = 1) -> str | None:
    """Why the Triton attention cannot run this shape (None: it can): `batch_heads` is b x heads of its inputs, a
    model's mbs x heads per TP rank. flash_attention refuses what it names, and training before it starts."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"supports head dims 1 to {MAX_HEAD_DIM} (a model's hidden_size / num_heads), and this one is {head_dim}"
    if batch_heads > MAX_BATCH_HEADS:
        return (f"supports b x heads (a model's mbs x heads per TP rank) up to {MAX_BATCH_HEADS} (CUDA's grid), "
                f"and this one is {batch_heads}")
    if dropout > 0 and seq_len > MAX_DROPOUT_SEQ:
        return f"supports dropout up to seq_len {MAX_DROPOUT_SEQ} (int32 RNG offsets), and seq_len = {seq_len}"
    return None


def triton_installed() -> bool:
    """Whether the triton package can be imported (found, not imported: Linux wheels only)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET, as @triton.jit reads it when
    a kernel module is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def _major_minor(version: str) -> tuple | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return tuple(int(v) for v in match.groups()) if match else None


@functools.cache
def interpreter_unsupported(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter cannot run these kernels with the installed triton and numpy (None: it can).
    Before triton 3.7 it makes a loop bound (`range(pid, ...)`) a Python int by int() of a one-element array,
    which numpy 2.4 refuses: every kernel with a loop fails with "only 0-dimensional arrays can be converted"."""
    if triton_version is None:                 # (the module's: pytorch-triton and others install it too)
        import triton
        triton_version = triton.__version__
    if numpy_version is None:
        import numpy
        numpy_version = numpy.__version__
    t, n = _major_minor(triton_version), _major_minor(numpy_version)
    if t and n and t < (3, 7) and n >= (2, 4):
        return (f"Triton's interpreter in triton {triton_version} cannot run these kernels with numpy "
                f"{numpy_version} (it fixes that in 3.7): install triton>=3.7 or numpy<2.4 for kernels on the CPU")
    return None


def check_device(x, interpret: bool, module: str) -> None:
    """Refuse a CPU tensor unless `module`'s kernels were imported under an interpreter that can run them."""
    if not x.is_cuda:
        if not interpret:
            raise RuntimeError(f"Triton kernels need CUDA tensors; on CPU set TRITON_INTERPRET=1 "
                               f"before importing {module}.")
        why = interpreter_unsupported()
        if why:
            raise RuntimeError(why)


@functools.cache
def compute_capability(device) -> int:
    """10 * major + minor of a CUDA device (90: H100, 80: A100)."""
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host (triton.cdiv and next_power_of_2 are constexpr functions there: about 3 us a
    call on this project's CPU, several a launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), on the host."""
    return 1 << max(n - 1, 0).bit_length()


def autotune(configs, key: list, prune):
    """triton.autotune over `configs` for the `key` arguments, pruned by prune(configs, named_args, **kwargs),
    its timings cached on disk where the installed triton can (autotune_cache)."""
    import triton
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune},
                           **autotune_cache(triton.autotune))


def autotune_cache(autotune) -> dict:
    """{"cache_results": True} where `autotune` (triton.autotune) takes it (triton 3.4 on), else {}: torch 2.4
    to 2.7's triton 3.0 to 3.3 has no disk cache of timings, and each process times the candidates again."""
    return {"cache_results": True} if "cache_results" in inspect.signature(autotune).parameters else {}


# autotuned kernel -> (its autotuner's cache, {key: the config it chose}) (launch_tuned): the choices are
# forgotten with the cache they came from, when something gives the autotuner a new one (tests do)
_CHOSEN: dict = {}


def launch_tuned(tuned, grid, *args, key: tuple, **meta) -> None:
    """tuned[grid](*args, **meta) for a triton.autotune'd kernel, launched the first time through the autotuner
    (which times its configs for its key, or reads their timings from disk) and afterwards straight, as the
    autotuner itself launches (tuned.fn with the chosen config's arguments), so Autotuner.run's host time
    (about 30 us a launch on the H100's host: docs/benchmarks.md, first GPU run) is paid once per key. `key`:
    the values of the kernel's autotune key arguments; the tensors' dtypes are added, as the autotuner does."""
    cache, chosen = _CHOSEN.get(tuned, (None, None))
    if cache is not tuned.cache:
        chosen = {}
        _CHOSEN[tuned] = (tuned.cache, chosen)
    key = (key, tuple(getattr(a, "dtype", None) for a in args))
    config = chosen.get(key)
    if config is None:
        tuned[grid](*args, **meta, **FP_FUSION)
        chosen[key] = tuned.best_config
    else:
        tuned.fn[grid](*args, **meta, **config.all_kwargs(), **FP_FUSION)


def as_rows(t, n_cols: int):
    """[..., N] -> a 2-D [rows, N] view with unit column stride (copies only if it must)."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(1) == 1 else t.contiguous()
