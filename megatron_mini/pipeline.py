"""Pipeline parallelism: the one engine that runs every schedule.

The model is the layer list [Embedding, Block_1 .. Block_L, Head] (indices 0 .. L+1), cut
into pp * vpp virtual stages by partition.py; local chunk c of PP rank r is virtual stage c*pp + r.

The engine executes this rank's action list from `schedules.build_schedule` literally:
a forward/backward runs a chunk on a microbatch; a run of consecutive send/recv actions is
posted as one batched isend/irecv and waited for. Sent activations are freed at once (only
their autograd graph is kept) and backward is started from the received gradient directly.
"""
from __future__ import annotations

import time

import torch
from torch.autograd import Variable
from torch.profiler import record_function

from . import comm
from .config import TrainConfig
from .partition import partition
from .schedules import build_schedule, comm_batches


def partition_for(cfg: TrainConfig) -> list:
    """The pp * vpp virtual stages of cfg's model (partition() with cfg's pipeline keys)."""
    return partition(cfg.model.num_layers, cfg.pp * cfg.vpp, cfg.embedding_stage,
                     cfg.pipeline_first_blocks, cfg.pipeline_last_blocks)


def local_stage_layers(cfg: TrainConfig, pp_rank: int) -> list:
    stages = partition_for(cfg)
    return [stages[c * cfg.pp + pp_rank] for c in range(cfg.vpp)]


def _run_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from `output` (whose storage may have been freed) with gradient `grad`."""
    Variable._execution_engine.run_backward((output,), (grad,), False, False, (), True, True)


class PipelineEngine:
    """Runs one training (or eval) step of this rank's schedule over its model chunks."""

    def __init__(self, chunks: list, buffers: list, mesh, cfg: TrainConfig, act_dtype: torch.dtype,
                 device: torch.device):
        self.chunks, self.buffers, self.mesh, self.cfg = chunks, buffers, mesh, cfg
        self.dtype, self.device = act_dtype, device
        self._schedules = {}    # microbatches per step -> (training actions, evaluation actions, last backwards)
        s = cfg.model.seq_len // (mesh.tp if cfg.sp else 1)
        self.act_shape = (s, cfg.mbs, cfg.model.hidden_size)
        self.trace = []    # (Action, t_start, t_end) of the last step, in execution order: host perf_counter
        #                    times, the work's on a CPU; on a GPU the launches' (no device sync is taken)

    def schedules(self, num_microbatches: int) -> tuple[list, list, set]:
        """(this rank's training actions, its evaluation actions (GPipe's forwards), each chunk's last backward,
        whose DP buckets may start reducing as they fill) for a step of `num_microbatches`, built once per count
        (a batch-size ramp runs several)."""
        if num_microbatches not in self._schedules:
            cfg, mesh = self.cfg, self.mesh
            train = build_schedule(cfg.schedule, mesh.pp, cfg.vpp, num_microbatches, mesh.pp_rank)
            gpipe = build_schedule("gpipe", mesh.pp, cfg.vpp, num_microbatches, mesh.pp_rank)
            last = set({a.chunk: (a.chunk, a.microbatch) for a in train if a.op == "backward"}.values())
            self._schedules[num_microbatches] = (
                train, [a for a in gpipe if a.op in ("forward", "send_act", "recv_act")], last)
        return self._schedules[num_microbatches]

    def train_step(self, batch: torch.Tensor, loss_scale: float, global_tokens: int, first_sample: int) -> torch.Tensor:
        """Forward and backward over the microbatches of `batch` [m, mbs, s+1], whose first sample has the
        global index `first_sample` (it keys the dropout masks); gradients land (DP-synced) in the main-grad
        buffers. Returns each sample's sum of token losses [m, mbs] (fp32; the last stage's, zeros elsewhere)."""
        actions, _, last_backward = self.schedules(len(batch))
        return self._run(actions, batch, loss_scale / global_tokens, first_sample, last_backward)

    @torch.no_grad()
    def eval_step(self, batch: torch.Tensor) -> torch.Tensor:
        """The forwards of `batch` [m, mbs, s+1]: each sample's sum of token losses [m, mbs], as train_step."""
        return self._run(self.schedules(len(batch))[1], batch, None, None, set())

    def _run(self, actions: list, batch: torch.Tensor, grad_scale: float | None, first_sample: int | None,
             last_backward: set) -> torch.Tensor:
        """`actions` over `batch`; `last_backward`: the (chunk, microbatch) backwards after which a chunk's DP
        buckets may start reducing (schedules())."""
        inputs, outputs, out_grads, in_grads = {}, {}, {}, {}
        losses = torch.zeros(batch.shape[:2], dtype=torch.float32, device=self.device)
        # the step's tokens reach the device in one copy, and only where a chunk reads them
        if any(c.has_embedding or c.has_head for c in self.chunks):
            batch = batch.to(self.device)
        self.trace = []
        for a in comm_batches(actions):
            if isinstance(a, tuple):
                self._exchange(a, inputs, outputs, out_grads, in_grads)
                continue
            start = time.perf_counter()
            with record_function(str(a)):      # (a range of its own in a profile.* trace: profiling.py)
                self._compute(a, batch, grad_scale, first_sample, last_backward, losses, inputs, outputs, out_grads,
                              in_grads)
            self.trace.append((a, start, time.perf_counter()))
        if grad_scale is not None:
            for buf in self.buffers:
                buf.finish_grad_sync()
        return losses

    def _compute(self, a, batch, grad_scale, first_sample, last_backward, losses, inputs, outputs, out_grads,
                 in_grads) -> None:
        """A forward or backward of chunk a.chunk on microbatch a.microbatch: its input from `inputs` (or the
        tokens), its output into `outputs` (and the next local chunk's `inputs`); a backward's output gradient from
        `out_grads` (or the loss), its input's gradient into `out_grads` (pp = 1) or `in_grads` (to send)."""
        pp, vpp = self.mesh.pp, self.cfg.vpp
        chunk, key = self.chunks[a.chunk], (a.chunk, a.microbatch)
        if a.op == "forward":
            tokens = batch[a.microbatch]
            if chunk.has_embedding:
                x = tokens[:, :-1]
            else:       # training keeps the input until its backward reads .grad; evaluation is done with it
                x = inputs[key] if grad_scale is not None else inputs.pop(key)
            sample = None if first_sample is None else first_sample + a.microbatch * self.cfg.mbs
            out = chunk(x, tokens[:, 1:] if chunk.has_head else None, sample=sample)
            if chunk.has_head:
                losses[a.microbatch] = out.detach()
                out = out.sum() * grad_scale if grad_scale is not None else out
            if grad_scale is not None or (pp > 1 and not chunk.has_head):    # (evaluation: only to send it)
                outputs[key] = out
            if pp == 1 and a.chunk + 1 < vpp:           # next virtual stage is on this rank
                inputs[(a.chunk + 1, a.microbatch)] = out.detach().requires_grad_(grad_scale is not None)
        else:
            if key in last_backward:
                self.buffers[a.chunk].start_last_microbatch()
            out = outputs.pop(key)
            if chunk.has_head:
                out.backward()
            else:
                _run_backward(out, out_grads.pop(key))
            if not chunk.has_embedding:
                grad = inputs.pop(key).grad
                if pp == 1:
                    out_grads[(a.chunk - 1, a.microbatch)] = grad
                else:
                    in_grads[key] = grad

    def _exchange(self, actions: list, inputs, outputs, out_grads, in_grads) -> None:
        """Post the batch of sends/receives together, wait, then free what was sent."""
        start = time.perf_counter()
        ops, sent = [], []
        for a in actions:
            key = (a.chunk, a.microbatch)
            if a.op == "send_act":
                ops.append(("send", outputs[key], a.peer))
                sent.append(outputs[key])
            elif a.op == "send_grad":
                ops.append(("send", in_grads.pop(key), a.peer))
            else:
                buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
                (inputs if a.op == "recv_act" else out_grads)[key] = buf
                ops.append(("recv", buf, a.peer))
        names = ", ".join(map(str, actions))
        with record_function(names):
            comm.batch_p2p(ops, self.mesh.pp_group, names)         # (a hang's message names them)
        for a in actions:
            if a.op == "recv_act":
                inputs[(a.chunk, a.microbatch)].requires_grad_(torch.is_grad_enabled())
        for t in sent:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        end = time.perf_counter()
        self.trace.extend((a, start, end) for a in actions)
