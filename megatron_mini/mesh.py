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
from .config import ConfigError
from .errors import CommError
from .launch import launch_env


class ParallelMesh:
    """timeout_s: how long a collective of any group may wait before it fails (default: the process
    group's); every subgroup gets it, so a stalled peer ends the job instead of hanging it.
    virtual_rank: the mesh as rank `virtual_rank` of the layout sees it, without processes (groups
    that record their calls and move nothing): what the planner builds models on the meta device with."""

    def __init__(self, tp: int, pp: int, dp: int, ledger: Ledger | None = None, timeout_s: int | None = None,
                 virtual_rank: int | None = None):
        self.tp, self.pp, self.dp = tp, pp, dp
        self.timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self.world_size = tp * pp * dp
        self.virtual = virtual_rank is not None
        if self.virtual:
            self.rank = virtual_rank
        else:
            self.rank = dist.get_rank() if dist.is_initialized() else 0
            assert (dist.get_world_size() if dist.is_initialized() else 1) == self.world_size
        self.tp_rank, self.dp_rank, self.pp_rank = self.coords(self.rank)
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

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank: rank_of's inverse."""
        return rank % self.tp, rank // self.tp % self.dp, rank // (self.tp * self.dp)

    def _build(self, name: str, all_ranks: list) -> Group:
        mine = None
        for ranks in all_ranks:
            pg = dist.new_group(ranks, timeout=self.timeout) if len(ranks) > 1 and not self.virtual else None
            if self.rank in ranks:
                mine = Group(name, ranks, pg, self.ledger, me=self.rank if self.virtual else None)
        return mine

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def __repr__(self) -> str:
        return (f"ParallelMesh(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp}, "
                f"dp={self.dp_rank}/{self.dp}, pp={self.pp_rank}/{self.pp})")


def choose_device(device: str, backend: str, local_rank: int, local_world_size: int,
                  gpus: int) -> tuple[torch.device, str]:
    """This rank's device and the job's process-group backend; ConfigError when they cannot work.

    device=auto: a GPU per rank (cuda:local_rank) when this node has a GPU for every one of its
    ranks, the CPU when it has none; fewer GPUs than ranks is an error with the ways out.
    device=cuda: ranks share the GPUs round-robin when they outnumber them (gloo only).
    backend=auto: nccl when every rank has a GPU of its own, else gloo (gloo's collectives take
    CUDA tensors; its point-to-point does not, so comm.batch_p2p stages those through the host).
    Every rank of a node decides from the same numbers, so all of them stop together.
    """
    if device == "auto":
        if gpus == 0:
            device = "cpu"
        elif local_world_size > gpus:
            raise ConfigError(
                f"This node runs {local_world_size} ranks but sees {gpus} GPU(s), and device=auto gives every "
                f"rank a GPU of its own. Either launch one rank per GPU (torchrun --nproc_per_node={gpus} ...), "
                f"or let the ranks share the GPUs with device=cuda (which uses the gloo backend), "
                f"or train on the CPU with device=cpu.")
        else:
            device = "cuda"
    if device == "cuda" and gpus == 0:
        raise ConfigError("device=cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is False: no GPU "
                          "is visible, or this torch is a CPU build); use device=cpu or device=auto.")
    shared = device == "cuda" and local_world_size > gpus
    if backend == "auto":
        backend = "nccl" if device == "cuda" and not shared else "gloo"
    if backend == "nccl" and device == "cpu":
        raise ConfigError("dist_backend=nccl needs device=cuda (NCCL moves GPU tensors only); use dist_backend=gloo "
                          "or auto on the CPU.")
    if backend == "nccl" and shared:
        raise ConfigError(f"dist_backend=nccl cannot put {local_world_size} ranks on {gpus} GPU(s) (NCCL needs a GPU "
                          f"per rank); use dist_backend=gloo (or auto) to share them, or "
                          f"torchrun --nproc_per_node={gpus}.")
    if device == "cpu":
        return torch.device("cpu"), backend
    return torch.device("cuda", local_rank % gpus), backend


def ranks_per_gpu(device: torch.device, local_world_size: int, gpus: int) -> float:
    """How many ranks each GPU of this node serves (choose_device shares them round-robin when the ranks
    outnumber them): local_world_size / min(local_world_size, gpus) on CUDA; 1 on a CPU."""
    if device.type != "cuda":
        return 1.0
    return local_world_size / min(local_world_size, gpus)


def init_process_group(device: torch.device, backend: str, timeout_s: int) -> None:
    """Join the job's default group on `backend` (SLURM runs need MASTER_ADDR/PORT set); a rendezvous
    that fails (a rank that never came, a port in use) is one CommError naming the address.

    One process needs no rendezvous: its store is in memory, so two single-process runs never contend
    for a port. Under torchrun the rendezvous goes through the agent's store with a prefix per attempt:
    torchrun keeps one store across the restarts of --max-restarts, and without the prefix a restarted
    attempt reads the previous attempt's addresses and waits to connect to dead processes."""
    if dist.is_initialized():
        return
    rank, world_size, _, _ = launch_env()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    extra = {"device_id": device} if backend == "nccl" else {}
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    try:
        if world_size == 1:
            extra["store"] = dist.HashStore()
        elif attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                  is_master=False, timeout=timeout)
            extra["store"] = dist.PrefixStore(f"megatron_mini/attempt_{attempt}", agent)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **extra)
    except dist.DistError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CommError(f"rank {rank}: joining the process group of {world_size} ranks at {address} failed ({first}); "
                        f"check that every rank was started, that MASTER_ADDR/MASTER_PORT reach rank 0 and the port is "
                        f"free (torchrun --standalone picks one), or raise timeout_s={timeout_s}") from None
