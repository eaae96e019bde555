"""Triton kernels with autograd wrappers: `kernels.layernorm` (FusedLayerNorm, layer_norm) and
`kernels.softmax` (scaled_masked_softmax, torch_scaled_masked_softmax).

Import the submodules directly; this package imports nothing (no triton) so that CPU-only code
can import it. On CPU the kernels run under the Triton interpreter: set TRITON_INTERPRET=1
before importing a submodule.
"""
