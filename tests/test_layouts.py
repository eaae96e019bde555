"""Layout invariance: every layout trains the same model as tp=pp=dp=1 (fp32, 20 steps).

Per-step losses within 1e-5 (relative) and final weights within 1e-5, for tensor, sequence,
pipeline (every schedule and embedding placement, uneven stages, fewer microbatches than stages) and data
parallelism and their mixes.
"""
import pytest

from harness import assert_same_training, small_config, train_on_ranks


@pytest.fixture(scope="module")
def references(small_data, tmp_path_factory):
    """tp=pp=dp=1 runs, one per model depth, computed on first use."""
    cache = {}

    def get(num_layers):
        if num_layers not in cache:
            cfg = small_config(small_data, tmp_path_factory.mktemp("ref"), gbs=GBS, **{"model.num_layers": num_layers})
            cache[num_layers] = train_on_ranks(1, cfg)
        return cache[num_layers]
    return get


LAYOUTS = {
    # tensor + sequence parallelism (2 blocks: depth does not matter here, collectives do; a block's output, its
    # sequence shards with sp, feeds the next block)
    "tp2": dict(tp=2, model__num_layers=2),
    "tp4": dict(tp=4, model__num_layers=2),
    "tp2-sp": dict(tp=2, sp=True, model__num_layers=2),
    "tp4-sp": dict(tp=4, sp=True, model__num_layers=2),
    "tp2-dp2-sp": dict(tp=2, sp=True, model__num_layers=2),
    # pipeline parallelism (8 blocks: up to pp=4 x vpp=2)
    "pp2-1f1b": dict(pp=2),
    "pp4-1f1b": dict(pp=4),
    "pp4-gpipe": dict(pp=4, schedule="gpipe"),
    "pp4-vpp2": dict(pp=4, vpp=2),
    "pp2-vpp2-own": dict(pp=2, vpp=2, embedding_stage="own"),
    "pp4-layer": dict(pp=4, embedding_stage="layer", model__num_layers=6),
    "pp4-vpp2-own": dict(pp=4, vpp=2, embedding_stage="own", model__num_layers=6),
    "pp3-vpp2": dict(pp=3, vpp=2, model__num_layers=6),      # 4 microbatches: groups of 4, not of pp
    "pp3-first2": dict(pp=3, pipeline_first_blocks=2),        # stages of 2+3+3 blocks; 4 microbatches over 3
    "pp2-vpp2-uneven": dict(pp=2, vpp=2, pipeline_first_blocks=1, pipeline_last_blocks=1),    # 1+3+3+1 blocks
    "pp4-mbs4": dict(pp=4, mbs=4),                            # 2 microbatches, fewer than the stages
    "pp1-vpp3-own": dict(vpp=3, embedding_stage="own"),       # hand-overs in process; the head reads chunk 0's
    "tp2-pp2-dp2-sp": dict(tp=2, pp=2, sp=True),
}
GBS = 8   # 4 microbatches of 2 at dp=1
WORLD = {"tp2": 2, "tp4": 4, "tp2-sp": 2, "tp4-sp": 4, "tp2-dp2-sp": 4, "pp2-1f1b": 2, "pp4-1f1b": 4,
         "pp4-gpipe": 4, "pp4-vpp2": 4, "pp2-vpp2-own": 2, "pp4-layer": 4, "pp4-vpp2-own": 4, "pp3-vpp2": 3,
         "pp3-first2": 3, "pp2-vpp2-uneven": 2, "pp4-mbs4": 4, "pp1-vpp3-own": 1, "tp2-pp2-dp2-sp": 8}


def _config(small_data, run_dir, layout):
    overrides = {k.replace("__", "."): v for k, v in LAYOUTS[layout].items()}
    return small_config(small_data, run_dir, gbs=GBS, **overrides)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_device(layout, small_data, references, tmp_path):
    cfg = _config(small_data, tmp_path, layout)
    history = train_on_ranks(WORLD[layout], cfg)
    assert_same_training(references(cfg.model.num_layers), history)


DROPOUT_LAYOUTS = {   # (world size, overrides): every layout but tp, with dropout 0.1 and GBS 8
    "dp2-zero-selective": (2, dict(zero=1, recompute="selective")),
    "pp2-vpp2-own-full": (2, dict(pp=2, vpp=2, embedding_stage="own", recompute="full")),
    "pp2-dp2-gpipe": (4, dict(pp=2, schedule="gpipe")),
}


@pytest.fixture(scope="module")
def dropout_reference(small_data, tmp_path_factory):
    return train_on_ranks(1, small_config(small_data, tmp_path_factory.mktemp("ref-dropout"), gbs=GBS,
                                          **{"model.dropout": 0.1}))


@pytest.mark.parametrize("layout", list(DROPOUT_LAYOUTS))
def test_dropout_trains_the_same_model_on_every_layout_but_tp(layout, small_data, references, dropout_reference,
                                                              tmp_path):
    """With dropout a mask is keyed by (seed, first sample of the microbatch, layer, tp rank) (rng.py), not by
    how far a stream has run: dp, ZeRO, pp, vpp, the embedding placement, the schedule and recompute train the
    same model as one process. (Dropout does act: the reference's losses are not those without it.)"""
    world, overrides = DROPOUT_LAYOUTS[layout]
    assert dropout_reference["loss"] != references(8)["loss"]
    cfg = small_config(small_data, tmp_path, gbs=GBS, **{"model.dropout": 0.1}, **overrides)
    assert_same_training(dropout_reference, train_on_ranks(world, cfg))


def test_sp_at_tp1_trains_the_one_device_model_and_says_it_splits_nothing(small_data, dropout_reference, tmp_path):
    """sp=true at tp=1 (Megatron turns it off with a warning): the same model as sp=false, dropout's masks
    included, and a start-up note that there is nothing to split."""
    cfg = small_config(small_data, tmp_path, gbs=GBS, sp=True, **{"model.dropout": 0.1})
    assert_same_training(dropout_reference, train_on_ranks(1, cfg))
    log = (tmp_path / "logs" / "rank0000.log").read_text()
    assert log.count("note: sp=true at tp=1 splits nothing") == 1
