"""Data parallelism trains the same model as one process (fp32, same global batch)."""
import pytest

from harness import assert_same_training, small_config, train_on_ranks


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory):
    return train_on_ranks(1, small_config(small_data, tmp_path_factory.mktemp("ref"), steps=10))


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_single_process(dp, small_data, reference, tmp_path):
    history = train_on_ranks(dp, small_config(small_data, tmp_path, steps=10))
    assert_same_training(reference, history)
