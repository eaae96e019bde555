"""(Run as python docs/probes/train_step_host_2026-11-23.py ROWS MBS from the repository root, on a GPU.)
Host vs GPU time of one training step: the same step at mbs 16 and mbs 1 (GPU work /16, launches the
same), split into the engine's forward/backward (host return, then sync) and the optimizer. On a CPU, a smoke
run of the tiny model (tests/test_bench_tools.py runs it so, to keep it in step with bench_gpu)."""
import os, sys, statistics, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
os.environ.setdefault("WANDB_MODE", "disabled")
import torch
import bench_gpu as bg
from megatron_mini.dataset import get_batch

cuda = torch.cuda.is_available()
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
key = "small" if cuda else None
rows = sys.argv[1].split(",") if len(sys.argv) > 1 else ["default", "layer_norm"]
mbss = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 1]

bg._init_one_rank_group()


def sync():
    if cuda: torch.cuda.synchronize()

print(f"{'row':12s} {'mbs':>4s} {'step ms':>8s} {'engine host ms':>15s} {'engine wall ms':>15s} {'opt ms':>8s}")
for row in rows:
    for mbs in mbss:
        model, _, m = bg.model_config("small", not cuda)
        r, _ = bg.build(row, model, mbs, m, dev, not cuda)
        t, cfg = r.trainer, r.cfg
        for _ in range(3):
            r.step()
        sync()
        res = []
        for _ in range(6):
            sync(); a = time.perf_counter()
            batch = get_batch(t.train_data, t.consumed_samples, cfg.gbs, cfg.mbs, 0, 1)
            ls = t.engine.train_step(batch, 1.0, cfg.gbs * cfg.model.seq_len, 0)
            b = time.perf_counter(); sync(); c = time.perf_counter()
            t.optimizer.step(1e-4); sync(); d = time.perf_counter()
            t.consumed_samples += cfg.gbs
            res.append((d - a, b - a, c - a, d - c))
        med = [statistics.median(x[i] for x in res) * 1e3 for i in range(4)]
        print(f"{row:12s} {mbs:4d} {med[0]:8.1f} {med[1]:15.1f} {med[2]:15.1f} {med[3]:8.1f}", flush=True)
        del r, t; bg._free(dev)
