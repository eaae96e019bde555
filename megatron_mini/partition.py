"""The pipeline partitioner: which layers of [Embedding, Block_1 .. Block_L, Head] each virtual stage holds.

`embedding_stage`:
    none   the embedding rides on the first block stage, the head on the last (Megatron)
    layer  the embedding and the head count as one block each when balancing (BLOOM)
    own    the embedding is a virtual stage of its own, the head another; blocks fill the rest
A split that cannot be made says which block counts, or which uneven placement, would work.
"""
from __future__ import annotations

from .errors import ConfigError


def _spread(n: int, stages: int, to_blocks, why: str, uneven: str = "") -> list:
    """n units evenly over `stages`; if impossible, say which block counts would work (and how to
    place this count unevenly, `uneven`)."""
    if stages < 1 or n % stages:
        lo, hi = n - n % stages, n - n % stages + stages
        options = ", ".join(str(to_blocks(u)) for u in (lo, hi) if u > 0 and to_blocks(u) > 0)
        raise ConfigError(f"Cannot split the model evenly over the pipeline: {why} "
                          f"Block counts that would work here: {options} (or change pp/vpp/embedding_stage"
                          f"{uneven}).")
    return [n // stages] * stages


def _uneven_hint(blocks: int, stages: int) -> str:
    """`, or ... pipeline_first_blocks=k`: the most balanced k with the other blocks even over the rest."""
    if stages < 2:
        return ""
    options = [(abs(k - (blocks - k) // (stages - 1)), k) for k in range(1, blocks)
               if (blocks - k) % (stages - 1) == 0]
    if not options:
        return ""
    first = min(options)[1]
    rest = (blocks - first) // (stages - 1)
    return (f", or place the blocks unevenly: pipeline_first_blocks={first} gives "
            f"{'+'.join([str(first)] + [str(rest)] * (stages - 1))}")


def partition(num_layers: int, num_stages: int, embedding_stage: str, first_blocks: int = 0,
              last_blocks: int = 0) -> list:
    """(first, end) indices into [Embedding, Block_1..L, Head] for each of the pp*vpp virtual stages.

    first_blocks / last_blocks (embedding_stage none or own): explicit block counts for the first
    and last block-holding stage; the other blocks spread evenly over the stages between.
    """
    L, S = num_layers, num_stages
    if embedding_stage == "own" and S < 3:
        raise ConfigError(f"embedding_stage=own needs at least 3 virtual stages (embedding, blocks, head); "
                          f"pp x vpp = {S}.")
    if S == 1:
        if first_blocks or last_blocks:
            raise ConfigError(f"pipeline_first_blocks={first_blocks}/pipeline_last_blocks={last_blocks} place blocks "
                              f"on pipeline stages, but pp x vpp = 1 is one stage holding all {L}; leave them 0.")
        return [(0, L + 2)]
    if embedding_stage == "layer":
        if first_blocks or last_blocks:
            raise ConfigError("pipeline_first_blocks/pipeline_last_blocks need embedding_stage=none or own.")
        counts = _spread(L + 2, S, lambda u: u - 2,
                         f"with embedding_stage=layer the {L} blocks + embedding + head = {L + 2} units must divide "
                         f"over pp x vpp = {S} virtual stages.")
    else:
        own = embedding_stage == "own"
        stages = S - 2 if own else S
        fixed = [n for n in (first_blocks, last_blocks) if n]
        placed = f"pipeline_first_blocks={first_blocks} + pipeline_last_blocks={last_blocks}"
        if len(fixed) > stages:
            raise ConfigError(f"{placed} name two block stages, but there is one (embedding_stage={embedding_stage}, "
                              f"pp x vpp = {S}) and it holds all {L} blocks; leave them 0.")
        if len(fixed) == stages == 1 and fixed[0] != L:
            raise ConfigError(f"{placed} place {fixed[0]} block{'s' * (fixed[0] != 1)} on the one block stage "
                              f"(embedding_stage={embedding_stage}, pp x vpp = {S}), which holds all {L}: set it to "
                              f"{L}, or leave it 0.")
        if len(fixed) == stages and sum(fixed) != L:
            raise ConfigError(f"{placed} place {sum(fixed)} blocks on the {stages} block stages, which must hold all "
                              f"{L}: make them add up to {L}, or set only one of them.")
        if len(fixed) < stages and sum(fixed) >= L:
            raise ConfigError(f"{placed} leave no blocks for the other {stages - len(fixed)} block stages of a "
                              f"{L}-block model.")
        hint = "" if fixed else _uneven_hint(L, stages)
        n_fixed = sum(fixed)
        rest = [] if len(fixed) == stages else _spread(
            L - n_fixed, stages - len(fixed), lambda u: u + n_fixed,
            f"{L - n_fixed} blocks must divide over {stages - len(fixed)} virtual stages "
            f"(embedding_stage={embedding_stage}, pp x vpp = {S}"
            + (f", {n_fixed} block{'s' * (n_fixed != 1)} placed explicitly)." if fixed else ")."), hint)
        blocks = ([first_blocks] if first_blocks else []) + rest + ([last_blocks] if last_blocks else [])
        counts = [1] + blocks + [1] if own else blocks
        if not own:
            counts[0] += 1
            counts[-1] += 1
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    return bounds


def blocks_in(num_layers: int, first: int, end: int) -> int:
    """How many blocks the layers [first, end) of [Embedding, Block_1..L, Head] hold."""
    return max(min(end, num_layers + 1) - max(first, 1), 0)
