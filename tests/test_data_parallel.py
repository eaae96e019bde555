"""Data parallelism trains the same model as one process (fp32, same global batch)."""
import pytest
import torch

from harness import assert_same_training, small_config, train_on_ranks


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory):
    return train_on_ranks(1, small_config(small_data, tmp_path_factory.mktemp("ref"), steps=10))


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_single_process(dp, small_data, reference, tmp_path):
    history = train_on_ranks(dp, small_config(small_data, tmp_path, steps=10))
    assert_same_training(reference, history)


def test_a_dropped_model_frees_its_buffers():
    """The parameters' autograd hooks hold their GradBuffer weakly: once the model is dropped, its flat
    weights and fp32 main grads are freed (a strong hook would keep them alive for the process's life)."""
    import gc
    import weakref

    from megatron_mini.config import ModelConfig, TrainConfig
    from megatron_mini.data_parallel import GradBuffer
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.model import ParallelContext, build_chunks

    model = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, seq_len=8, vocab_size=100)
    cpu, mesh = torch.device("cpu"), ParallelMesh(1, 1, 1)

    def build_and_train():
        (chunk,) = build_chunks(model, ParallelContext.one_device(cpu), [(0, 3)], 1, cpu)
        buf = GradBuffer(list(chunk.named_global_parameters()), mesh, torch.float32, zero=False,
                         bucket_numel=TrainConfig.ddp_bucket_numel)
        ids = torch.randint(0, 100, (2, 9))
        chunk(ids[:, :-1], ids[:, 1:]).sum().backward()
        assert buf.grads_flat.abs().sum() > 0
        return weakref.ref(buf), weakref.ref(buf.grads_flat), weakref.ref(buf.params_flat)

    refs = build_and_train()
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("value, message", [
    (0, "ddp_bucket_numel=0 must be >= 1 (fp32 main-grad elements per DP bucket)."),
    (-4, "ddp_bucket_numel=-4 must be >= 1 (fp32 main-grad elements per DP bucket)."),
    (2.5, "ddp_bucket_numel=2.5 must be an integer >= 1 (fp32 main-grad elements per DP bucket)."),
    (True, "ddp_bucket_numel=True must be an integer >= 1 (fp32 main-grad elements per DP bucket)."),
], ids=["zero", "negative", "fraction", "bool"])
def test_a_bucket_size_below_one_element_is_refused(value, message):
    """ddp_bucket_numel is a whole number of elements, at least 1: anything else is one line before any process
    group exists (validate, on every rank), naming the key and its unit."""
    from megatron_mini.config import ConfigError, TrainConfig, validate

    with pytest.raises(ConfigError) as refused:
        validate(TrainConfig(ddp_bucket_numel=value), 1)
    assert str(refused.value) == message
    assert validate(TrainConfig(ddp_bucket_numel=1), 1) == 1
