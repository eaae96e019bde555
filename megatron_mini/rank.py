"""What one rank holds for training: its model chunks, a GradBuffer per chunk and the Optimizer over
them (build_rank), and the step's loss all-reduce (reduce_loss). Training builds its ranks with these;
the layout planner (plan_meta.py) builds the ranks of a layout on the meta device with them too."""
from __future__ import annotations

import torch

from . import comm
from .config import TrainConfig
from .data_parallel import GradBuffer
from .launch import StopRequest
from .mesh import ParallelMesh
from .model import ParallelContext, build_chunks, compiles, select_triton_ops, tp_ranks_may_round_apart
from .optimizer import Optimizer
from .partition import blocks_in
from .pipeline import local_stage_layers
from .rng import RNGTracker

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_rank(cfg: TrainConfig, mesh: ParallelMesh, rng: RNGTracker, device: torch.device,
               chunks: list | None = None) -> tuple:
    """This rank's model chunks (in the model dtype, initialised unless on meta), a GradBuffer per
    chunk and the Optimizer over them: (chunks, buffers, optimizer). The planner builds ranks with it
    too, on meta, passing the chunks (in the model dtype) of a rank it built before to lay out buffers another
    way (ZeRO)."""
    dtype = DTYPES[cfg.precision.dtype]
    if chunks is None:
        ctx = ParallelContext(mesh.tp_group, rng, cfg.sp, cfg.recompute,
                              select_triton_ops(cfg.kernels, cfg.model, device, cfg.tp, cfg.precision.dtype, cfg.mbs),
                              compiles(cfg, device))
        chunks = [chunk.to(dtype) for chunk in build_chunks(cfg.model, ctx, local_stage_layers(cfg, mesh.pp_rank),
                                                            cfg.seed, device)]
    seen, buffers = set(), []
    for chunk in chunks:
        params = [(n, p) for n, p in chunk.named_global_parameters() if id(p) not in seen]
        seen.update(id(p) for _, p in params)
        buffers.append(GradBuffer(params, mesh, dtype, zero=cfg.zero == 1, bucket_numel=cfg.ddp_bucket_numel))
    for chunk in chunks:            # every chunk waits for the weights it uses, whichever buffer holds them
        for buf in buffers:
            buf.wait_before(chunk.param_users())
    return chunks, buffers, Optimizer(buffers, mesh, cfg.optimizer, cfg.precision, zero=cfg.zero == 1,
                                      average_replicated=tp_ranks_may_round_apart(cfg.kernels, cfg.tp, cfg.sp))


def state_bytes_at_least(cfg: TrainConfig, dp: int, pp_rank: int) -> int:
    """A lower bound of the bytes that build_rank's rank `pp_rank` keeps for the whole run (its Optimizer's
    memory_bytes()), from the config alone: the weight matrices of its blocks, its word embedding and positions,
    the output layer's copy on a last stage that does not hold the embedding (biases and LayerNorms left out), each
    element as a weight in the model's dtype, an fp32 main grad and Adam's fp32 state (two moments, and a master
    with 16-bit weights: 1/dp of them with ZeRO-1). training._start_rank refuses a model that cannot fit with it
    before building one."""
    m = cfg.model
    h, vocab = m.hidden_size, m.padded_vocab_size // cfg.tp * m.hidden_size
    stages = local_stage_layers(cfg, pp_rank)
    embedding = any(a == 0 for a, _ in stages)
    elements = sum(blocks_in(m.num_layers, a, b) * (4 * h * h + 2 * h * m.ffn_hidden_size) // cfg.tp
                   + (a == 0) * (vocab + m.seq_len * h) + (b == m.num_layers + 2 and not embedding) * vocab
                   for a, b in stages)
    weight = DTYPES[cfg.precision.dtype].itemsize
    adam = 8 + 4 * (weight < 4)
    return elements * weight + elements * 4 + elements * adam // (dp if cfg.zero else 1)


def reduce_loss(mesh: ParallelMesh, sample_losses: torch.Tensor, stop: str | None, device: torch.device,
                writing: bool = False, failed: bool = False) -> torch.Tensor:
    """[each of the global batch's gbs samples' sum of token losses, in batch order (this DP rank's n = gbs / dp,
    `sample_losses` [m, mbs] of the engine, the last stage's, at positions [dp_rank n, (dp_rank + 1) n) as
    get_batch takes them), the number of ranks still writing a checkpoint, the number of ranks whose write of
    their own failed (rank 0's metrics.jsonl: Trainer.write_alone), then per reason of StopRequest.REASONS (a
    signal, the time limit) the number of ranks that asked to stop for it (`stop`: this rank's, StopRequest.asked)]:
    one world all-reduce of gbs + 2 + len(REASONS) floats."""
    names, n = StopRequest.REASONS, sample_losses.numel()
    gbs = n * mesh.dp
    t = torch.zeros(gbs + 2 + len(names), device=device)
    if mesh.is_last_stage and mesh.tp_rank == 0:
        t[mesh.dp_rank * n:(mesh.dp_rank + 1) * n] = sample_losses.flatten().float()
    t[gbs] = float(writing)
    t[gbs + 1] = float(failed)
    if stop is not None:
        t[gbs + 2 + names.index(stop)] = 1.0
    comm.all_reduce(t, mesh.world_group)
    return t
