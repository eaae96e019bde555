"""Reading prepared data: packed, shuffled GPT samples, the train/validation split, DP batches.

`load_datasets` opens a directory built by data.prepare() (nothing is rebuilt here) and checks it
against the run; every problem is a one-line DataError naming the file and the command that rebuilds
exactly the directory the run reads, or, for a valid directory holding other data, one beside it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import DataConfig
from .data import DataError, IndexedDataset, Tokenizer, check_holds, open_checked, read_json, rebuild_command


def split_documents(num_docs: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) sorted document ids: round(val_fraction * num_docs) documents (at least 1, at most all
    but one) drawn by seed go to validation."""
    if num_docs < 2 or not 0 < val_fraction < 1:
        raise ValueError(f"cannot hold out val_fraction={val_fraction} of {num_docs} documents")
    n_val = min(max(1, round(val_fraction * num_docs)), num_docs - 1)
    perm = np.random.default_rng(seed).permutation(num_docs)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


class GPTDataset:
    """Packed samples over documents `doc_ids` of `indexed`, concatenated in that order (EOS separates them).
    Sample k is tokens [k*seq_len, k*seq_len + seq_len + 1) of the concatenation: consecutive samples share
    one token (as in Megatron), so each token but the first is a target exactly once per epoch.
    len() = samples per epoch; dataset[i] for any i >= 0 is sample perm_e[i % len] of epoch e = i // len,
    where perm_e is a permutation seeded by (seed, e). Returns np.int64 [seq_len + 1]."""

    def __init__(self, indexed: IndexedDataset, doc_ids, seq_len: int, seed: int):
        ids = np.asarray(doc_ids, np.int64)
        # runs of consecutive documents are contiguous in tokens.bin: each run is one segment
        first = np.concatenate([[0], np.flatnonzero(np.diff(ids) != 1) + 1])
        last = np.concatenate([first[1:] - 1, [len(ids) - 1]])
        self._seg_start = indexed.offsets[ids[first]]
        seg_len = indexed.offsets[ids[last]] + indexed.sizes[ids[last]] - self._seg_start
        self._seg_cum = np.concatenate([[0], np.cumsum(seg_len)])
        self.indexed, self.seq_len, self.seed = indexed, seq_len, seed
        self.num_docs, self.num_tokens = len(ids), int(self._seg_cum[-1])
        self._len = (self.num_tokens - 1) // seq_len
        if self._len < 1:
            raise ValueError(f"{len(ids)} documents hold {self.num_tokens} tokens, fewer than one sample of "
                             f"seq_len + 1 = {seq_len + 1}")
        self._perm_epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            raise IndexError(f"sample index {i} < 0")
        epoch, k = divmod(int(i), self._len)
        if epoch != self._perm_epoch:
            self._perm_epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self._len)
        start = int(self._perm[k]) * self.seq_len
        end, seg = start + self.seq_len + 1, int(np.searchsorted(self._seg_cum, start, side="right")) - 1
        parts = []
        while start < end:
            take = min(end, int(self._seg_cum[seg + 1])) - start
            parts.append(self.indexed.span(int(self._seg_start[seg]) + start - int(self._seg_cum[seg]), take))
            start, seg = start + take, seg + 1
        return np.concatenate(parts).astype(np.int64)


def first_sample(consumed_samples: int, gbs: int, dp_rank: int, dp: int) -> int:
    """The global index of DP rank `dp_rank`'s first sample in the global batch starting at `consumed_samples`."""
    return consumed_samples + dp_rank * (gbs // dp)


def get_batch(dataset: GPTDataset, consumed_samples: int, gbs: int, mbs: int, dp_rank: int, dp: int,
              vocab: tuple | None = None):
    """This DP rank's share of the global batch that starts at sample `consumed_samples`: global position j
    is dataset[consumed_samples + j]; rank d takes positions [d*gbs/dp, (d+1)*gbs/dp) in order, as
    microbatches of mbs. Returns torch.LongTensor [gbs / (dp*mbs), mbs, seq_len + 1].

    vocab = (vocab_size, DataConfig): also refuse an id outside [0, vocab_size) (check_token_ids' DataError).
    The rank then reads the whole global batch, so every rank reaches the same verdict before the step's
    first collective (a damaged tokens.bin otherwise failed tp=1's embedding lookup, and became zero rows at
    tp > 1); at dp = 1 its own rows are the whole batch, and the check costs a min and a max."""
    import torch  # here, so the data tools and their worker processes do not pay for importing torch

    if gbs % (dp * mbs):
        raise ValueError(f"gbs={gbs} is not divisible by dp x mbs = {dp} x {mbs}")
    per_rank = gbs // dp
    first, count = (first_sample(consumed_samples, gbs, dp_rank, dp), per_rank) if vocab is None else \
        (consumed_samples, gbs)
    rows = np.stack([dataset[first + j] for j in range(count)])
    if vocab is not None:
        _refuse_ids(rows, dataset, first, *vocab)
        rows = rows[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return torch.from_numpy(rows).view(per_rank // mbs, mbs, rows.shape[1])


def check_token_ids(dataset: GPTDataset, first: int, count: int, vocab_size: int, cfg: DataConfig) -> None:
    """Samples [first, first + count) hold only ids in [0, vocab_size): a damaged tokens.bin fails here,
    before an id indexes past the embedding."""
    _refuse_ids(np.stack([dataset[first + j] for j in range(count)]), dataset, first, vocab_size, cfg)


def _refuse_ids(rows: np.ndarray, dataset: GPTDataset, first: int, vocab_size: int, cfg: DataConfig) -> None:
    """DataError when samples first, first + 1, ... (`rows`) hold an id outside [0, vocab_size)."""
    if rows.size and (rows.min() < 0 or rows.max() >= vocab_size):
        bad = rows[(rows < 0) | (rows >= vocab_size)]
        raise DataError(dataset.indexed.bin_path, f"holds token id {int(bad[0])}, outside the vocabulary of "
                        f"{vocab_size} (in samples {first}..{first + len(rows) - 1})", rebuild_command(cfg))


def data_meta(cfg: DataConfig) -> dict:
    """meta.json of a prepared data directory (load_datasets has checked it)."""
    return read_json(Path(cfg.dir) / "meta.json") or {}


def load_datasets(cfg: DataConfig, seq_len: int, seed: int,
                  vocab_size: int) -> tuple[GPTDataset, GPTDataset, Tokenizer]:
    """Open cfg.dir (built by prepare(); nothing is rebuilt here), check it against cfg and the model's
    vocab_size, split documents (cfg.val_fraction, by seed) and return (train, val, tokenizer).
    Any problem raises a one-line DataError naming the file and the command that rebuilds it."""
    out = Path(cfg.dir)
    try:
        tok = Tokenizer(out / "tokenizer.model")
        ds, meta = open_checked(out, tok)
    except DataError as e:           # missing or broken: rebuilding this very directory repairs it
        raise e.with_rebuild(rebuild_command(cfg)) from None
    check_holds(cfg, tok, meta, {"data.vocab_size": cfg.vocab_size, "model.vocab_size": vocab_size}, training=True)
    try:
        train_ids, val_ids = split_documents(len(ds), cfg.val_fraction, seed)
        return GPTDataset(ds, train_ids, seq_len, seed), GPTDataset(ds, val_ids, seq_len, seed + 1), tok
    except ValueError as e:
        raise DataError(ds.bin_path, f"{e}; use a larger corpus, a larger data.val_fraction or a shorter sequence",
                        rebuild=None) from None
