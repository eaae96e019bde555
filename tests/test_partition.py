"""The pipeline partitioner: every placement of the embedding and head, and its error messages."""
import pytest

from megatron_mini.config import ConfigError
from megatron_mini.partition import partition


def sizes(bounds):
    return [end - start for start, end in bounds]


def test_bloom_layer_placement():
    # BLOOM: 70 blocks + embedding + head = 72 units over 12 stages, 6 each
    bounds = partition(70, 12, "layer")
    assert sizes(bounds) == [6] * 12 and bounds[0][0] == 0 and bounds[-1][1] == 72


def test_own_and_none_placements():
    assert sizes(partition(10, 12, "own")) == [1] + [1] * 10 + [1]       # the design-card run: pp=12
    assert sizes(partition(8, 4, "none")) == [3, 2, 2, 3]                 # embedding + 2 blocks, ..., 2 blocks + head
    assert sizes(partition(8, 1, "none")) == [10]
    assert sizes(partition(9, 4, "none", first_blocks=3)) == [4, 2, 2, 3]


def test_explicit_first_and_last_counts():
    assert sizes(partition(10, 4, "none", first_blocks=2, last_blocks=4)) == [3, 2, 2, 5]
    assert sizes(partition(7, 5, "own", first_blocks=1, last_blocks=4)) == [1, 1, 2, 4, 1]
    with pytest.raises(ConfigError, match="embedding_stage=none or own"):
        partition(8, 4, "layer", first_blocks=1)
    with pytest.raises(ConfigError, match="pp x vpp = 1 is one stage"):   # not silently ignored
        partition(8, 1, "none", last_blocks=3)
    for stages in (1, 2):                                                 # (at 1 it was ignored)
        with pytest.raises(ConfigError, match=f"embedding_stage=own needs at least 3 virtual stages .* = {stages}"):
            partition(8, stages, "own")


@pytest.mark.parametrize("layers,stages,placement,works", [(7, 2, "none", "6, 8"), (7, 4, "layer", "6, 10"),
                                                            (9, 6, "own", "8, 12")])
def test_uneven_splits_name_block_counts_that_work(layers, stages, placement, works):
    with pytest.raises(ConfigError, match=f"Block counts that would work here: {works}"):
        partition(layers, stages, placement)


def test_own_needs_three_stages():
    with pytest.raises(ConfigError, match="at least 3 virtual stages"):
        partition(8, 2, "own")


def test_first_and_last_counts_may_place_every_block():
    """Two block stages both placed explicitly: accepted when the counts are the model's blocks, else refused."""
    assert sizes(partition(8, 2, "none", first_blocks=3, last_blocks=5)) == [4, 6]
    assert sizes(partition(4, 4, "own", first_blocks=1, last_blocks=3)) == [1, 1, 3, 1]
    with pytest.raises(ConfigError, match="make them add up to 8, or set only one"):
        partition(8, 2, "none", first_blocks=3, last_blocks=4)
    with pytest.raises(ConfigError, match="name two block stages, but there is one"):
        partition(8, 3, "own", first_blocks=1, last_blocks=2)


def test_every_suggested_block_count_works():
    """A refusal's "Block counts that would work here" are each accepted with the same settings (a count
    equal to the explicitly placed blocks, which leaves the other stages none, was once suggested)."""
    import itertools
    import re
    checked = 0
    for layers, stages, first, last in itertools.product(range(1, 13), range(2, 7), range(3), range(3)):
        for placement in ("none", "own") + (("layer",) if not (first or last) else ()):
            try:
                partition(layers, stages, placement, first, last)
            except ConfigError as e:
                found = re.search(r"would work here: ([\d, ]+)", str(e))
                for count in (found.group(1).split(", ") if found else []):
                    partition(int(count), stages, placement, first, last)
                    checked += 1
    assert checked > 500


@pytest.mark.parametrize("first, last", [(1, 0), (0, 1)])
def test_one_block_stage_with_one_count_says_how_to_fix_it(first, last):
    """embedding_stage=own at pp x vpp = 3 has one block stage: a count for it must be all L blocks (it advised
    "set only one of them" when only one was set). Its L is accepted."""
    with pytest.raises(ConfigError, match=r"place 1 block on the one block stage .* holds all 4: set it to 4, "
                                          r"or leave it 0\.$"):
        partition(4, 3, "own", first, last)
    assert partition(4, 3, "own", 4 * bool(first), 4 * bool(last)) == partition(4, 3, "own", 0, 0)
