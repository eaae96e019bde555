"""ParallelMesh: this rank's (tp, dp, pp) coordinates and the process groups between them.

Ranks are ordered tp fastest, then dp, then pp (Megatron's "tp-dp-pp"):

    global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so a TP group is `tp` consecutive ranks (one node) and PP peers are `tp*dp` apart.
The embedding group is the first and last PP stage of one (tp, dp) column (tied embeddings);
the model-parallel group is all tp*pp ranks holding one replica.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import Group, Ledger


class ParallelMesh:
    def __init__(self, tp: int, pp: int, dp: int, ledger: Ledger | None = None):
        self.tp, self.pp, self.dp = tp, pp, dp
        self.world_size = tp * pp * dp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        assert (dist.get_world_size() if dist.is_initialized() else 1) == self.world_size
        self.tp_rank = self.rank % tp
        self.dp_rank = (self.rank // tp) % dp
        self.pp_rank = self.rank // (tp * dp)
        self.ledger = ledger or Ledger()
        # Every rank creates every group in the same order (new_group is collective).
        rank_of = self.rank_of
        self.tp_group = self._build("tp", [[rank_of(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)])
        self.dp_group = self._build("dp", [[rank_of(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)])
        self.pp_group = self._build("pp", [[rank_of(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)])
        self.embedding_group = self._build(
            "emb", [sorted({rank_of(t, d, 0), rank_of(t, d, pp - 1)}) for d in range(dp) for t in range(tp)])
        self.mp_group = self._build("mp", [[rank_of(t, d, p) for p in range(pp) for t in range(tp)] for d in range(dp)])
        self.world_group = self._build("world", [list(range(self.world_size))])

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def _build(self, name: str, all_ranks: list) -> Group:
        mine = None
        for ranks in all_ranks:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine = Group(name, ranks, pg, self.ledger)
        return mine

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def __repr__(self) -> str:
        return (f"ParallelMesh(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp}, "
                f"dp={self.dp_rank}/{self.dp}, pp={self.pp_rank}/{self.pp})")


def launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables, else SLURM's, else a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def init_process_group(device: torch.device, timeout_s: int) -> None:
    """Join the job's default group: nccl on GPUs, gloo on CPU (SLURM runs need MASTER_ADDR/PORT set)."""
    if dist.is_initialized():
        return
    rank, world_size, _ = launch_env()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
