"""Reading prepared data: packed, shuffled GPT samples, the train/validation split, DP batches.

`load_datasets` opens a directory built by data.prepare(), or the directories of a data.blend mixed by weight
(BlendedDataset; nothing is rebuilt here), and checks them against the run; every problem is a one-line DataError
naming the file and the command that rebuilds exactly the directory the run reads, or, for a valid directory holding
other data, one beside it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from .config import ConfigError, DataConfig
from .data import DataError, IndexedDataset, Tokenizer, check_holds, open_checked, read_json, rebuild_command


class ShortSplit(ValueError):
    """A train/validation split one of whose sets (`which`) holds less than one sample."""

    def __init__(self, which: str, problem: str):
        super().__init__(f"the {which} set: {problem}")
        self.which = which


def split(indexed: IndexedDataset, val_fraction: float, seq_len: int, seed: int) -> tuple:
    """(train, validation) GPTDatasets of `indexed`: by documents (split_documents), or where it holds one document
    (a .txt file; nanoGPT's split of shakespeare.txt), by tokens: its first 1 - val_fraction for training, the rest
    for validation. ShortSplit where either holds less than one sample."""
    n = indexed.num_tokens
    if len(indexed) > 1:
        ids = split_documents(len(indexed), val_fraction, seed)
        spans = (None, None)
    else:
        cut = round((1 - val_fraction) * n)
        ids, spans = ([0], [0]), ((0, cut), (cut, n))
    parts = []
    for which, doc_ids, span, s in zip(("training", "validation"), ids, spans, (seed, seed + 1)):
        try:
            parts.append(GPTDataset(indexed, doc_ids, seq_len, s, span))
        except ValueError as e:
            problem = str(e) if span is None else (f"one document of {n:,} tokens, split by tokens, gives it "
                                                   f"{span[1] - span[0]:,}, fewer than one sample of seq_len + 1 = "
                                                   f"{seq_len + 1}")
            raise ShortSplit(which, problem) from None
    return tuple(parts)


def split_documents(num_docs: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) sorted document ids: round(val_fraction * num_docs) documents (at least 1, at most all
    but one) drawn by seed go to validation: the first n_val of rng(seed).permutation(num_docs) (shuffled), marked
    rather than sorted: O(num_docs), 30M documents in 1.8 s, not 4. For num_docs >= 2 (split) and 0 < val_fraction < 1
    (check_ranges, wherever a config comes from: train.py, prepare_data.py, a checkpoint's meta.json)."""
    n_val = min(max(1, round(val_fraction * num_docs)), num_docs - 1)
    held = np.zeros(num_docs, bool)
    held[shuffled(num_docs, seed)[:n_val]] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def shuffled(n: int, seed) -> np.ndarray:
    """rng(seed).permutation(n), shuffled in place in int32 where n allows: the same order at half the memory."""
    order = np.arange(n, dtype=np.int32 if n < 2 ** 31 else np.int64)
    np.random.default_rng(seed).shuffle(order)
    return order


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The samples 0..n-1 in epoch `epoch`'s order: rng([seed, epoch]).permutation(n) (shuffled: a 146M-sample epoch
    holds 0.55 GiB, not 1.1)."""
    return shuffled(n, [seed, epoch])


class GPTDataset:
    """Packed samples over documents `doc_ids` of `indexed`, concatenated in that order (EOS separates them).
    Sample k is tokens [k*seq_len, k*seq_len + seq_len + 1) of the concatenation: consecutive samples share
    one token (as in Megatron), so each token but the first is a target once per epoch, but for the last
    (num_tokens - 1) mod seq_len, which no sample reaches: the same tokens in every epoch, as the concatenation's
    order is fixed (Megatron shuffles its documents per epoch and lets a sample run on into the next epoch).
    len() = samples per epoch; dataset[i] for any i >= 0 is sample perm_e[i % len] of epoch e = i // len,
    where perm_e is a permutation seeded by (seed, e). Returns np.int64 [seq_len + 1]."""

    def __init__(self, indexed: IndexedDataset, doc_ids, seq_len: int, seed: int, span: tuple | None = None):
        """`span` (start, stop): tokens [start, stop) of tokens.bin instead of whole documents (a corpus of one
        document's train/validation split: split), doc_ids then the document that holds them."""
        ids = np.asarray(doc_ids, np.int64)
        if span is None:
            # runs of consecutive documents are contiguous in tokens.bin: each run is one segment
            first = np.concatenate([[0], np.flatnonzero(np.diff(ids) != 1) + 1])
            last = np.concatenate([first[1:] - 1, [len(ids) - 1]])
            self._seg_start = indexed.offsets[ids[first]]
            seg_len = indexed.offsets[ids[last]] + indexed.sizes[ids[last]] - self._seg_start
        else:
            self._seg_start, seg_len = np.array([span[0]], np.int64), np.array([span[1] - span[0]], np.int64)
        self._seg_cum = np.concatenate([[0], np.cumsum(seg_len)])
        self.indexed, self.seq_len, self.seed = indexed, seq_len, seed
        self.num_docs, self.num_tokens = len(ids), int(self._seg_cum[-1])
        self._len = (self.num_tokens - 1) // seq_len
        if self._len < 1:
            raise ValueError(f"{len(ids)} document{'s hold' if len(ids) != 1 else ' holds'} {self.num_tokens:,} "
                             f"tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}")
        self._perm_epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self._len

    def locate(self, i: int) -> tuple:
        return self, int(i)

    def __getitem__(self, i: int) -> np.ndarray:
        epoch, k = divmod(int(i), self._len)
        if epoch != self._perm_epoch:
            self._perm_epoch, self._perm = epoch, epoch_order(self._len, self.seed, epoch)
        start = int(self._perm[k]) * self.seq_len
        end, seg = start + self.seq_len + 1, int(np.searchsorted(self._seg_cum, start, side="right")) - 1
        parts = []
        while start < end:
            take = min(end, int(self._seg_cum[seg + 1])) - start
            parts.append(self.indexed.span(int(self._seg_start[seg]) + start - int(self._seg_cum[seg]), take))
            start, seg = start + take, seg + 1
        return np.concatenate(parts).astype(np.int64)


class BlendedDataset:
    """Samples of `datasets` mixed by `shares` (Fractions summing to 1; Megatron's BlendedDataset, in closed form).
    The stream is periodic in blocks of B samples, B the least common denominator of the shares (at most MAX_BLOCK;
    a share then counts c_d = its largest-remainder part of B): each block takes the next c_d samples of dataset d,
    in that dataset's own order, its j-th of them at the rank of (j + 1/2) / c_d among all (Sainte-Lague's
    interleaving: after any n samples, d has given within 1/2 + w_d (k - 2) / 2 of n w_d, w_d = c_d / B, k datasets:
    1/2 for two). So

        dataset[i] = datasets[d][q c_d + j],   q, r = divmod(i, B),   (d, j) = the block's r-th entry,

    for any i >= 0, in O(1); each dataset runs through its own epochs (GPTDataset). len() = the samples read before
    any dataset's first sample is read again (the blend's epoch)."""

    MAX_BLOCK = 1 << 20

    def __init__(self, datasets: list, shares: list):
        self.datasets, self.shares = list(datasets), list(shares)
        self.counts = blend_counts(self.shares, self.MAX_BLOCK)
        self.block = sum(self.counts)
        which = np.repeat(np.arange(len(self.counts)), self.counts)
        rank = np.concatenate([np.arange(c) for c in self.counts])
        order = np.lexsort((which, (2 * rank + 1) / (2 * np.asarray(self.counts)[which])))
        self._which, self._rank = which[order], rank[order]
        position = np.empty(self.block, np.int64)
        position[order] = np.arange(self.block)
        first = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        # dataset d's sample len(d) (its epoch's end) is read at block q, position of its j-th entry
        ends = [q * self.block + int(position[first[d] + j])
                for d, (q, j) in enumerate(divmod(len(ds), c) for ds, c in zip(self.datasets, self.counts))]
        self._len = min(ends)

    def __len__(self) -> int:
        return self._len

    def which(self, first: int, count: int) -> np.ndarray:
        """The dataset (its index in `datasets`) of each of blended samples [first, first + count)."""
        return self._which[(first + np.arange(count)) % self.block]

    def locate(self, i: int) -> tuple:
        """(dataset, its sample index) of blended sample i."""
        q, r = divmod(int(i), self.block)
        d = int(self._which[r])
        return self.datasets[d], q * self.counts[d] + int(self._rank[r])

    def __getitem__(self, i: int) -> np.ndarray:
        dataset, j = self.locate(i)
        return dataset[j]


def split_notes(train, val, val_fraction: float) -> list[str]:
    """A start-up line for each directory (data.dir, or a blend's) whose validation documents hold more than twice
    val_fraction of its tokens: the split draws documents, not tokens, so a corpus of a few large files (a directory
    of .txt books) can hold most of its tokens out of training (5 files, one of 91% of the tokens: seed 1234 trained
    on the other 9%, without a word)."""
    pairs = zip(train.datasets, val.datasets) if isinstance(train, BlendedDataset) else [(train, val)]
    notes = []
    for t, v in pairs:
        share = v.num_tokens / (t.num_tokens + v.num_tokens)
        if share > 2 * val_fraction:
            notes.append(f"note: the validation set of {t.indexed.bin_path.parent} holds {share:.1%} of its tokens, "
                         f"in {v.num_docs:,} of its {t.num_docs + v.num_docs:,} documents (data.val_fraction="
                         f"{val_fraction:g} draws documents, not tokens), so training reads {1 - share:.1%} of them; "
                         f"split its large files into more documents (a .jsonl line each) to train on most of it")
    return notes


def blend_note(train: BlendedDataset) -> str:
    """The start-up line of a blend: each directory's share and training samples an epoch, and the samples the
    blend reads before one of them repeats (len)."""
    parts = ", ".join(f"{float(share):.4g} {ds.indexed.bin_path.parent} ({len(ds):,} samples an epoch)"
                      for ds, share in zip(train.datasets, train.shares))
    return (f"data.blend: {parts}; {len(train):,} samples of the blend read each once, then "
            f"{train.locate(len(train))[0].indexed.bin_path.parent} repeats first")


def blend_counts(shares: list, max_block: int) -> list:
    """The samples of each share in a block of B (BlendedDataset's c_d): B = the shares' least common denominator, at
    most max_block, and c_d = B share_d rounded by largest remainders (ties to the earlier dataset), so sum c_d = B;
    ValueError for a share that rounds to no sample."""
    block = min(math.lcm(*(s.denominator for s in shares)), max_block)
    exact = [s * block for s in shares]
    counts = [math.floor(x) for x in exact]
    for d in sorted(range(len(shares)), key=lambda d: (-(exact[d] - counts[d]), d))[:block - sum(counts)]:
        counts[d] += 1
    if 0 in counts:
        raise ValueError(f"a weight of {float(shares[counts.index(0)]):.2e} of the total rounds to no sample in a "
                         f"block of {block}")
    return counts


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


def _refuse_ids(rows: np.ndarray, dataset, first: int, vocab_size: int, cfg: DataConfig) -> None:
    """DataError when samples first, first + 1, ... (`rows`) hold an id outside [0, vocab_size): it names the
    tokens.bin of the first such sample (a blend's directory) and the command that rebuilds it."""
    bad = (rows < 0) | (rows >= vocab_size)
    if rows.size and bad.any():
        row = int(np.flatnonzero(bad.any(axis=1))[0])
        part, j = dataset.locate(first + row)
        own = f" of the blend, its sample {j}" if j != first + row else ""
        raise DataError(part.indexed.bin_path, f"holds token id {int(rows[row][bad[row]][0])}, outside the vocabulary "
                        f"of {vocab_size} (in sample {first + row}{own})",
                        rebuild_command(part_config(cfg, part.indexed.bin_path.parent)))


def directory_meta(directory) -> dict:
    """A prepared directory's meta.json ({} where it has none, or one that is no JSON object)."""
    meta = read_json(Path(directory) / "meta.json")
    return meta if isinstance(meta, dict) else {}


def part_config(cfg: DataConfig, directory) -> DataConfig:
    """The DataConfig that builds `directory`, one the run reads: cfg itself for its data.dir (without a blend), else a
    directory read by its path (a blend's, data.eval's) with the corpus (and text_key) its meta.json names (`<corpus>`
    where it names none; tools/prepare_data.py)."""
    if cfg.blend is None and Path(directory) == Path(cfg.dir):
        return cfg
    meta = directory_meta(directory)
    source, text_key = meta.get("source"), meta.get("text_key")
    return dataclasses.replace(cfg, dir=str(directory), blend=None, tokenizer=None,
                               source=source if isinstance(source, str) else "<corpus>",
                               text_key=text_key if isinstance(text_key, str) else cfg.text_key)


def open_part(cfg: DataConfig, vocab_size: int, first: Tokenizer | None = None,
              key: str = "data.blend") -> tuple[IndexedDataset, Tokenizer, dict]:
    """(tokens, tokenizer, meta.json) of prepared directory cfg.dir (nothing is rebuilt here), checked against cfg and
    the model's vocab_size, and for a blend's later directory or an evaluation set (config `key`), first against the
    run's tokenizer, `first`; one DataError naming the file and the command that rebuilds it."""
    out = Path(cfg.dir)
    if not out.is_dir():                 # (a mistyped path, or data never prepared: no "rebuild"; the run's tokenizer)
        command = rebuild_command(cfg, **({"tokenizer": first.path} if first else {}))
        raise DataError(out, f"no such directory (a mistyped path, or data not prepared there yet); prepare it with: "
                        f"{command}", rebuild=None)
    try:
        tok = Tokenizer(out / "tokenizer.model")
        ds, meta = open_checked(out, tok)
    except DataError as e:           # missing or broken: rebuilding this very directory repairs it; one that holds
        # no build yet, a blend's or data.eval's, is prepared with the run's tokenizer
        given = {"tokenizer": first.path} if first and not (out / "meta.json").is_file() else {}
        raise e.with_rebuild(rebuild_command(cfg, **given)) from None
    if first and tok.sha256 != first.sha256:
        raise DataError(tok.path, f"is another tokenizer (sha256 {tok.sha256[:12]}, {tok.vocab_size} tokens) than "
                        f"{first.path} ({first.sha256[:12]}): "
                        f"{f'the directories of {key}' if key.startswith('data.') else key} must share one, so that a "
                        f"token id means the same text in each; prepare {meta.get('source', 'its corpus')} with "
                        f"data.tokenizer={first.path} in a data.dir of its own and "
                        f"{'blend' if key == 'data.blend' else 'evaluate'} that", rebuild=None)
    check_holds(cfg, tok, meta, {"data.vocab_size": cfg.vocab_size, "model.vocab_size": vocab_size}, training=True)
    return ds, tok, meta


def open_parts(cfg: DataConfig, vocab_size: int) -> list:
    """[(share, tokens, tokenizer, meta)] of each directory the run reads (DataConfig.parts: data.dir, or data.blend's),
    all of one tokenizer (a token id must mean the same text in each) and of distinct corpora."""
    opened = []
    for share, directory in cfg.parts():
        part = part_config(cfg, directory)
        first = opened[0][2] if opened else None
        ds, tok, meta = open_part(part, vocab_size, first)
        sha = meta.get("corpus_sha256")         # (None: a meta.json without one, which matches no other)
        twin = next((d for _, d, _, m in opened if sha is not None and m.get("corpus_sha256") == sha), None)
        if twin is not None:
            raise DataError(f"data.blend: {directory}", f"holds the corpus of {twin.bin_path.parent} (the same "
                            f"sha256): give each corpus once, with the sum of its weights", rebuild=None)
        opened.append((share, ds, tok, meta))
    return opened


def load_datasets(cfg: DataConfig, seq_len: int, seed: int,
                  vocab_size: int) -> tuple[GPTDataset | BlendedDataset, GPTDataset | BlendedDataset, Tokenizer]:
    """Open the prepared directories of cfg (data.dir, or data.blend's; nothing is rebuilt here), check them against
    cfg and the model's vocab_size, split each one's documents (cfg.val_fraction, by seed) and return (train, val,
    tokenizer): GPTDatasets, or BlendedDatasets of a blend's, train and validation mixed alike.
    Any problem raises a one-line DataError naming the file and the command that rebuilds it."""
    train, val = [], []
    parts = open_parts(cfg, vocab_size)
    for _, ds, _, _ in parts:
        try:
            for part, into in zip(split(ds, cfg.val_fraction, seq_len, seed), (train, val)):
                into.append(part)
        except ShortSplit as e:
            fix = f"a {'larger' if e.which == 'validation' else 'smaller'} data.val_fraction"
            if ds.num_tokens <= seq_len:        # (no val_fraction helps: the whole corpus is shorter than one sample)
                e, fix = f"{e}, as the whole corpus does ({ds.num_tokens:,} tokens)", None
            raise DataError(ds.bin_path, f"{e}; use a larger corpus{', ' + fix if fix else ''} or a shorter sequence "
                            f"(model.seq_len)", rebuild=None) from None
    if cfg.blend is None:
        return train[0], val[0], parts[0][2]
    shares = [share for share, *_ in parts]
    try:
        return BlendedDataset(train, shares), BlendedDataset(val, shares), parts[0][2]
    except ValueError as e:
        raise ConfigError(f"data.blend={list(cfg.blend)}: {e}; raise that weight or leave its directory out.") from None


EVAL_SEED = 0        # data.eval's samples: the same for every run (any seed), a yardstick across runs and mixtures


def eval_corpora(cfg: DataConfig) -> dict:
    """{data.eval's directory: the corpus sha256 its meta.json records (None without one)}."""
    return {d: directory_meta(d).get("corpus_sha256") for d in cfg.eval_dirs()}


def trained_eval_notes(cfg: DataConfig) -> list[str]:
    """A start-up line for each data.eval set that holds a corpus the run trains on (data.dir or a blend's directory:
    the same corpus sha256 in their meta.json, a copy too): but for the validation split, its documents are
    training documents, so its eval_loss is no held-out yardstick."""
    trained = {directory_meta(d).get("corpus_sha256"): d for _, d in cfg.parts()}
    evals = eval_corpora(cfg)
    return [f"data.eval: {d} holds the corpus of {trained[sha]}, which this run trains on (all but its "
            f"validation part): its eval_loss is mostly a training loss, not a held-out one"
            for d, sha in evals.items() if sha is not None and sha in trained]


def load_eval_sets(cfg: DataConfig, seq_len: int, vocab_size: int, tokenizer: Tokenizer,
                   key: str = "data.eval") -> dict:
    """{directory: GPTDataset of all its documents, shuffled by EVAL_SEED} of data.eval's prepared directories,
    each checked as a run's data (open_part) and encoded with the run's `tokenizer` (its ids must mean the same text);
    one DataError naming the file otherwise (and them as `key` does: data.eval, or a tool's own)."""
    sets = {}
    for directory in cfg.eval_dirs():
        ds, _, _ = open_part(part_config(cfg, directory), vocab_size, tokenizer, key)
        try:
            sets[directory] = GPTDataset(ds, np.arange(len(ds)), seq_len, EVAL_SEED)
        except ValueError as e:
            raise DataError(ds.bin_path, f"{e}; an evaluation set needs at least one sample", rebuild=None) from None
    return sets


def load_run_data(cfg) -> tuple:
    """(train, val, tokenizer, {data.eval's directory: its set}) of the run config `cfg` (load_datasets and
    load_eval_sets), whose training set must hold a global batch; a ConfigError (DataError) otherwise. No torch:
    train.py loads them before it imports torch (seconds), so a data directory missing or broken is refused in under
    one."""
    datasets = load_datasets(cfg.data, cfg.model.seq_len, cfg.seed, cfg.model.vocab_size)
    datasets += (load_eval_sets(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, datasets[2]),)
    if cfg.gbs > len(datasets[0]):          # (every rank reads the whole global batch: get_batch)
        raise ConfigError(f"gbs={cfg.gbs} is more samples than the training set holds ({len(datasets[0]):,} "
                          f"samples of seq_len + 1 = {cfg.model.seq_len + 1} tokens"
                          f"{', read before a directory of data.blend repeats' if cfg.data.blend else ''}), so "
                          f"every step would read some of them more than once: lower gbs, or train on a larger "
                          f"corpus.")
    return datasets


def data_identity(cfg: DataConfig, datasets: tuple) -> dict:
    """What the train/validation split and the token ids depend on, besides seed and val_fraction, recorded in each
    checkpoint (a resume must read the same data): the tokenizer, the corpus (a blend's: its shares and corpora), its
    token count and the fingerprint of its token files (a blend's: with its shares); and {data.eval's directory: its
    corpus sha256}, which a resume may change. `datasets`: load_datasets' (train, val, tokenizer) of cfg, whose
    IndexedDatasets hold the fingerprints that opening them compared with meta.json (each read once)."""
    train, _, tokenizer = datasets[:3]
    metas = [(share, directory, directory_meta(directory)) for share, directory in cfg.parts()]
    tokens = [part.indexed.fingerprint for part in (train.datasets if isinstance(train, BlendedDataset) else [train])]
    identity = {"tokenizer_sha256": tokenizer.sha256, "corpus_sha256": metas[0][2].get("corpus_sha256"),
                "num_tokens": metas[0][2].get("num_tokens"), "tokens_fingerprint": tokens[0]}
    if cfg.eval:                         # (a resume may change these: checkpoint.evaluation_changes notes it)
        identity["eval"] = eval_corpora(cfg)
    if len(metas) == 1:                  # (a blend of one directory reads its samples as data.dir does)
        return identity

    def sha256(pairs: list) -> str:
        return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()
    return {**identity, "corpus_sha256": sha256([[str(share), meta.get("corpus_sha256")] for share, _, meta in metas]),
            "num_tokens": sum(meta.get("num_tokens") or 0 for *_, meta in metas),
            "tokens_fingerprint": sha256([[str(share), t] for (share, _, _), t in zip(metas, tokens)]),
            "blend": [f"{float(share):.12g} {directory}" for share, directory, _ in metas]}
