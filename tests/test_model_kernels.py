"""kernels=triton trains the same model as the torch reference path: on the GPU when there is one
(fp32 with TF32 off, so both paths do IEEE fp32 math), else on CPU under the Triton interpreter."""
import torch

from harness import small_config, train_on_ranks


def test_triton_kernels_train_like_torch(small_data, tmp_path):
    overrides = {"model.num_layers": 2, "steps": 3, "gbs": 4, "device": "auto", "precision.tf32": False}
    runs = {k: train_on_ranks(1, small_config(small_data, tmp_path / k, kernels=k, **overrides))
            for k in ("torch", "triton")}
    a, b = torch.tensor(runs["torch"]["loss"]), torch.tensor(runs["triton"]["loss"])
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (a.tolist(), b.tolist())


def test_compiled_blocks_train_like_eager(small_data, tmp_path):
    """compile=true (torch.compile per block, inductor; linears and collectives stay eager) trains the
    same model as eager: inductor's fused pointwise kernels round like eager to ~1e-7 per op."""
    overrides = {"model.num_layers": 2, "steps": 3, "gbs": 4, "kernels": "torch"}
    runs = [train_on_ranks(1, small_config(small_data, tmp_path / str(c), compile=c, **overrides)) for c in (False, True)]
    a, b = torch.tensor(runs[0]["loss"]), torch.tensor(runs[1]["loss"])
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (a.tolist(), b.tolist())
