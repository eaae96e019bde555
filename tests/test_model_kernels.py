"""kernels=triton (under the interpreter on CPU) trains the same model as the torch reference path."""
import torch

from harness import small_config, train_on_ranks


def test_triton_kernels_train_like_torch(small_data, tmp_path):
    overrides = {"model.num_layers": 2, "steps": 3, "gbs": 4}
    torch_run = train_on_ranks(1, small_config(small_data, tmp_path / "torch", kernels="torch", **overrides))
    triton_run = train_on_ranks(1, small_config(small_data, tmp_path / "triton", kernels="triton", **overrides))
    a, b = torch.tensor(torch_run["loss"]), torch.tensor(triton_run["loss"])
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (a.tolist(), b.tolist())
