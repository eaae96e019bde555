"""Data preparation: corpus -> sentencepiece tokenizer -> indexed token dataset (megatron_mini/dataset.py
reads it into packed, shuffled GPT samples).

Files in DataConfig.dir, each written atomically (tmp file + os.replace):
  tokenizer.model  sentencepiece BPE; tokenizer.json records what it was trained on (for caching), or the file it
                   is a copy of (data.tokenizer: the corpus encoded with another data's tokenizer)
  tokens.bin       every document's tokens followed by EOS, back to back (uint16 if the vocab fits, else int32)
  tokens.idx       header <8s magic, u32 version, u8 dtype code, 3 pad bytes, u64 num_docs>, then
                   int64 sizes[num_docs] (tokens per document, EOS included), int64 offsets[num_docs] (in tokens)
  meta.json        tokenizer sha256, vocab size, documents, tokens, source, python version, corpus sha256, dtype,
                   tokens_fingerprint (of tokens.bin and .idx: written last, so files it does not describe are seen)
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import platform
import random
import re
import shlex
import shutil
import signal
import struct
import sys
import sysconfig
import time
import zlib
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import sentencepiece as spm

from megatron_mini.config import ConfigError, DataConfig
from megatron_mini.files import (DirectoryLock, atomic_write, existing_part, remove_empty_dirs, remove_left_temporaries,
                                 is_superseded_build, superseded_build, temporary_name, unwritable_dir)
from megatron_mini.launch import STOPPING, signal_at_parent_death, signals_held

_MAGIC = b"MMINIIDX"
_VERSION = 1
_HEADER = struct.Struct("<8sIB3xQ")
_DTYPES = {1: np.uint16, 2: np.int32}
_CHUNK_CHARS = 2000          # tokenizer training "sentences" are multi-line chunks, so newlines are learned
_BATCH_CHARS = 1 << 18       # characters per encoding task sent to a worker
_CHECK_DOCS = 1 << 20       # documents of tokens.idx checked at a time when it is opened
_PIECE_CHARS = 1 << 16       # a longer document is encoded in pieces of about this many characters (_pieces)
_FILES = ("tokenizer.model", "tokenizer.json", "tokens.bin", "tokens.idx", "meta.json")   # what prepare writes
_TOKENIZER_SETTINGS = 1      # bump when the training options below change: cached tokenizers are retrained


class DataError(ConfigError):
    """Missing, corrupt or mismatched data: one line naming the file, the problem and the rebuild command."""

    def __init__(self, what: object, problem: str, rebuild: str | None = "make data"):
        self.what, self.problem = str(what), " ".join(problem.split())
        super().__init__(f"{self.what}: {self.problem}" + (f"; rebuild it with: {rebuild}" if rebuild else ""))

    def with_rebuild(self, rebuild: str) -> "DataError":
        return DataError(self.what, self.problem, rebuild)


def rebuild_command(cfg: DataConfig, **changes) -> str:
    """The command that (re)builds exactly the directory `cfg.dir` (with `changes` applied to the data
    keys): `make data` for the default data, else prepare_data.py with every key that decides the
    directory and its contents (source, dir, vocab_size, and text_key and the tokenizer keys where they differ;
    data.tokenizer too where the directory's tokenizer.json records one)."""
    values = {"source": cfg.source, "dir": cfg.dir, "vocab_size": cfg.vocab_size, **changes}
    for key in ("text_key", "tokenizer", "tokenizer_sample_chars", "tokenizer_seed"):
        if getattr(cfg, key) != getattr(DataConfig, key):
            values[key] = getattr(cfg, key)
    if not cfg.tokenizer and (given := (read_json(Path(cfg.dir) / "tokenizer.json") or {}).get("given")):
        values["tokenizer"] = given          # (a directory of a given tokenizer is rebuilt with it)
    if values == {k: getattr(DataConfig, k) for k in ("source", "dir", "vocab_size")}:
        return "make data"
    return "python tools/prepare_data.py " + " ".join(f"data.{k}={shlex.quote(str(v))}" for k, v in values.items())


def new_dir_hint(cfg: DataConfig, what: str, run_also: tuple = (), **changes) -> str:
    """For a valid directory that holds other data than the run asks for: never suggest overwriting
    it; suggest building `what` in a directory of its own, and reading it from there (with the keys
    `run_also` too, key=value)."""
    source, vocab = changes.get("source", cfg.source), changes.get("vocab_size", cfg.vocab_size)
    name = "stdlib" if source == "stdlib" else Path(source).stem or "corpus"
    new = os.path.join(os.path.dirname(os.path.normpath(cfg.dir)), f"{name}-v{vocab}")   # a sibling of cfg.dir
    if os.path.normpath(new) == os.path.normpath(cfg.dir):
        new += "-new"
    command = rebuild_command(dataclasses.replace(cfg, dir=new), **changes)
    keys = " ".join([f"data.dir={new}"] + [f"data.{k}={shlex.quote(str(v))}" for k, v in changes.items()]
                    + list(run_also))
    return (f"{cfg.dir} is left as it is; to train on {what}, build it in its own directory with: {command} "
            f"and run with {keys}")


# ----------------------------------------------------------------------------------------------- corpus

JSONL = (".jsonl", ".jsonl.gz")          # a document per line, as {"<text_key>": "..."}; .gz read through gzip
SPACE_SYMBOL = "\u2581"                  # sentencepiece's whitespace: a literal one in a text encodes as a space


class Corpus:
    """The documents of data.source in a fixed order, empty ones dropped, read from its files again on each pass
    (never all in memory: a corpus may be larger than it): "stdlib" (the interpreter's standard library, one document
    per .py file, site-/dist-packages excluded), a .jsonl (or .jsonl.gz) file with a `text_key` string per line, a
    .txt file (one document), or a directory of such files, every one below it in the order of their paths (a
    corpus in shards; `ignored`: its other files). A source that is none of these is a DataError here. Once
    read_corpus has described it (sha256), each pass checks that it reads the same documents again: a corpus that
    changed in between (a file written during prepare) is a DataError at the pass's end, before anything built from
    it is kept. `empty`: the empty documents the last pass left out; `spaced`: how many of its documents held U+2581
    (sentencepiece's whitespace symbol, which it encodes as a space), and the first one's file."""

    def __init__(self, source: str, text_key: str = "text"):
        self.source, self.text_key, self.none, self.sha256 = source, text_key, "no non-empty documents", None
        self.files, self.ignored, self.empty, self.spaced = [], [], 0, (0, None)
        if source == "stdlib":
            self.files = [Path(p) for p in _stdlib_files()]
        elif Path(source).is_dir():
            for p in sorted(p for p in Path(source).rglob("*") if p.is_file()):     # (one pass: shards are many)
                (self.files if p.name.endswith((".txt", *JSONL)) else self.ignored).append(p)
            self.none += "" if self.files else " (it holds no .txt, .jsonl or .jsonl.gz file)"
        elif Path(source).is_file() and source.endswith((".txt", *JSONL)):
            self.files = [Path(source)]
        else:
            what = "is a file but not a .txt, .jsonl or .jsonl.gz file" if Path(source).is_file() else "not found"
            raise DataError(f"data.source={source}", f"{what}; use 'stdlib', a .jsonl (or .jsonl.gz) file with a "
                            f"\"{text_key}\" field per line, a .txt file, or a directory of such files", rebuild=None)

    def __iter__(self):
        digest, changed = hashlib.sha256(), "changed while it was being prepared"
        self.empty, self.spaced = 0, (0, None)
        for path in self.files:
            try:
                docs = _read_jsonl(path, self.text_key) if path.name.endswith(JSONL) else \
                    [_read_text(path, strict=self.source != "stdlib")]
                for doc in docs:
                    self.empty += not doc
                    if SPACE_SYMBOL in doc:
                        self.spaced = (self.spaced[0] + 1, self.spaced[1] or path)
                    if doc:
                        _add_doc(digest, doc)
                        yield doc
            except OSError as e:
                if self.sha256 is None:
                    raise
                raise DataError(f"data.source={self.source}", f"{changed} ({path}: {e.strerror or e}); prepare it "
                                f"again once it is complete", rebuild=None) from None
        if self.sha256 is not None and digest.hexdigest() != self.sha256:
            raise DataError(f"data.source={self.source}", f"{changed} (its sha256 differs from the first read's); "
                            f"prepare it again once it is complete", rebuild=None)
        self.sha256 = digest.hexdigest()


def read_corpus(source: str, text_key: str = "text") -> tuple[Corpus, dict]:
    """data.source's Corpus and, from one pass over it, its description {source, python, corpus_sha256 (of each
    document's UTF-8 length and bytes, in order), num_docs, num_chars}; a DataError where it has no document."""
    corpus, num_docs, num_chars = Corpus(source, text_key), 0, 0
    for doc in corpus:
        num_docs, num_chars = num_docs + 1, num_chars + len(doc)
    if not num_docs:
        raise DataError(f"data.source={source}", corpus.none, rebuild=None)
    jsonl = {"text_key": text_key} if any(p.name.endswith(JSONL) for p in corpus.files) else {}   # (what it read)
    return corpus, {"source": source_id(source), **jsonl, "python": platform.python_version(),
                    "corpus_sha256": corpus.sha256, "num_docs": num_docs, "num_chars": num_chars}


def _add_doc(digest, doc: str) -> None:
    """digest += the UTF-8 length of `doc` (8 bytes, little-endian) and its UTF-8 bytes (fed apart: no third copy
    of a long document)."""
    b = doc.encode()
    digest.update(len(b).to_bytes(8, "little"))
    digest.update(b)


def source_id(source: str) -> str:
    return source if source == "stdlib" else str(Path(source).resolve())


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _read_text(path, strict: bool = True) -> str:
    """A .txt file's text: UTF-8 (a byte-order mark kept, as it always was: a corpus's sha256 stays what it was), or
    a DataError naming the line and byte where it is not (a latin-1 file read as UTF-8 would be trained on as U+FFFD
    where each such byte was); the stdlib's files, not `strict`, with such bytes replaced (a few of its test files
    are in other encodings)."""
    with open(path, "rb") as f:
        raw = f.read()
    if not strict:
        return raw.decode("utf-8", errors="replace")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1)
        raise DataError(f"{path}:{line}", f"not valid UTF-8 (byte {column + 1} of the line: "
                        f"{raw[e.start:e.start + 1]!r}); convert it first (iconv -f latin1 -t utf-8)",
                        None) from None


def _read_jsonl(path: Path, text_key: str):
    """The `text_key` string of each non-blank line, in order (a generator): UTF-8 (a leading byte-order mark is
    allowed), JSON, no lone surrogate (JSON can escape one, UTF-8 cannot hold it); a line that is none of these names
    itself (its number in the decompressed text of a .gz), unless the .gz is damaged (its checksum, at its end, is
    read first)."""
    try:
        yield from _parse_jsonl(path, text_key)
    except DataError:
        if path.name.endswith(".gz"):
            for _ in _lines(path):          # (a DataError of its own where the file is damaged)
                pass
        raise


def _parse_jsonl(path: Path, text_key: str):
    for lineno, raw in _lines(path):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}", f"not valid UTF-8 (byte {e.start + 1} of the line: "
                            f"{raw[e.start:e.start + 1]!r})", None) from None
        if not line.strip():
            continue
        text, problem = _json_text(line, text_key)
        if problem:
            cut = "" if raw.endswith(b"\n") or not problem.startswith(": not valid JSON") else \
                "; it is the file's last line, with no newline after it: was the file cut short?"
            raise DataError(f"{path}:{lineno}", f"expected a JSON object with a \"{text_key}\" string{problem}{cut}",
                            None)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{path}:{lineno}", f"the text holds a lone surrogate ({text[e.start]!r} at character "
                            f"{e.start + 1}), which is no Unicode character", None) from None
        yield text


def _json_text(line: str, text_key: str) -> tuple[str | None, str]:
    """(the `text_key` string of a JSON line, "") or (None, what the line is instead, to follow "expected a JSON
    object with a "<text_key>" string"): not JSON (json's reason and column), another JSON value, an object without
    that field (its fields), or one where it is no string."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f": not valid JSON ({e.msg.removesuffix(' at')} at character {e.pos + 1} of the line)"
    except RecursionError as e:                    # (arrays nested ~1000 deep; Python's words differ by version)
        return None, f": not valid JSON as Python reads it (nested too deeply: {e})"
    except ValueError as e:                        # (an integer of over 4300 digits)
        return None, f": not valid JSON as Python reads it ({str(e) or type(e).__name__})"
    if not isinstance(obj, dict):
        return None, f": the line is {_json_type(obj)}"
    if text_key not in obj:
        fields = ", ".join(f'"{k}"' for k in list(obj)[:8]) + (", ..." if len(obj) > 8 else "")
        return None, (" (data.text_key names another field)" if text_key == "text" else "") + (
            f": its fields are {fields}" if obj else ": the object is empty")
    if not isinstance(obj[text_key], str):
        return None, f": its \"{text_key}\" is {_json_type(obj[text_key])}"
    return obj[text_key], ""


def _json_type(value) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object",
            str: "a string", type(None): "null"}[type(value)]


def _lines(path: Path):
    """(number from 1, bytes) of each line of `path`, decompressed where it is a .gz: a damaged one (cut short,
    not gzip) is a DataError naming it."""
    try:
        with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as f:
            yield from enumerate(f, 1)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(path, f"is not a whole gzip file ({e})", None) from None


# -------------------------------------------------------------------------------------------- tokenizer

class Tokenizer:
    """A sentencepiece model file: encode(str) -> list[int] (no EOS), decode(list[int]) -> str.
    Attributes: path, data (the file's bytes, as read: what a checkpoint keeps a copy of), sha256 (of them),
    vocab_size, eos_id."""

    def __init__(self, path):
        self.path = Path(path)
        if self.path.is_dir():
            inside = " (give its tokenizer.model)" if (self.path / "tokenizer.model").is_file() else ""
            raise DataError(self.path, f"is a directory, not a sentencepiece model file{inside}")
        if not self.path.is_file():
            raise DataError(self.path, "missing")
        data = self.path.read_bytes()
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except RuntimeError:
            raise DataError(self.path, "not a valid sentencepiece model") from None
        self.data, self.sha256 = data, hashlib.sha256(data).hexdigest()
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


def train_tokenizer(docs, vocab_size: int, sample_chars: int, seed: int, path, record: dict | None = None) -> None:
    """Train a byte-fallback BPE on about `sample_chars` characters of seeded-shuffled multi-line chunks
    of `docs` (tokenizer_sample): identity normalisation, whitespace kept (runs of spaces are pieces), digits split,
    "\\n" and "\\t" always in the vocabulary; id 0 = <unk>, 1 = EOS, no BOS/PAD. The same inputs give
    the same model file on any machine (with the same sentencepiece version). With `record`, `path`'s .json gets it
    and the model's sha256 (what prepare's cache compares). Sentencepiece answers no signal while it trains: the
    signals of launch.stop_on_signals are held from its start to the last write, so that one coming meanwhile stops
    the process once the trained tokenizer is kept."""
    sample = tokenizer_sample(docs, sample_chars, seed)
    total = sum(map(len, sample))
    model = io.BytesIO()
    with signals_held():
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sample), model_writer=model, model_type="bpe", vocab_size=vocab_size,
                byte_fallback=True, split_digits=True, normalization_rule_name="identity",
                remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
                required_chars="\n\t", character_coverage=0.9999, max_sentence_length=4 * _CHUNK_CHARS + 16,
                unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, num_threads=1, minloglevel=2)  # 1 thread: reproducible
        except RuntimeError as e:
            raise DataError(path, _tokenizer_failure(str(e), vocab_size, total), rebuild=None) from None
        atomic_write(path, model.getvalue())
        if record is not None:
            atomic_write(Path(path).with_suffix(".json"), json.dumps(
                {**record, "sha256": hashlib.sha256(model.getvalue()).hexdigest()}, indent=1).encode())


def tokenizer_sample(docs, sample_chars: int, seed: int) -> list[str]:
    """The chunks (_chunks) of `docs` (iterated twice: a list or a Corpus) in the order random.Random(seed).shuffle
    puts them, up to the first at which they hold `sample_chars` characters. Without holding the corpus: a first pass
    keeps each chunk's length (4 bytes), the shuffle permutes their indices (4 bytes each), and a second pass keeps
    only the chunks chosen."""
    if iter(docs) is docs:
        raise TypeError("tokenizer_sample reads the documents twice: give a list or a Corpus, not an iterator")
    lengths = array("I", (len(c) for d in docs for c in _chunks(d)))
    order = array("I", range(len(lengths)))
    random.Random(seed).shuffle(order)           # (shuffle's draws depend on the length alone: the chunks' order)
    rank, total = {}, 0
    for i in order:
        if total >= sample_chars:
            break
        rank[i], total = len(rank), total + lengths[i]
    sample = [""] * len(rank)
    chunks = (c for d in docs for c in _chunks(d))
    for i, chunk in enumerate(chunks):
        if i in rank:
            sample[rank[i]] = chunk
    return sample


def _tokenizer_failure(message: str, vocab_size: int, chars: int) -> str:
    """sentencepiece's reason, in data.vocab_size's terms where it is the vocabulary's size."""
    small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if small:
        return (f"data.vocab_size={vocab_size} is too small for this corpus: its tokenizer needs at least "
                f"{small[1]} tokens (256 bytes, <unk>, EOS and each character it keeps); "
                f"set data.vocab_size >= {small[1]}")
    large = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message)
    if large:
        return (f"data.vocab_size={vocab_size} is too large for this corpus ({chars:,} characters sampled): "
                f"its tokenizer can learn at most {large[1]} tokens; "
                f"set data.vocab_size <= {large[1]} or use a larger corpus")
    if vocab_size < 258:             # (sentencepiece fails placing EOS: "insert_id(trainer_spec_.eos_id() ...")
        return (f"data.vocab_size={vocab_size} is too small: a tokenizer needs 256 byte tokens, <unk> and EOS, and "
                f"one for each character it keeps; set data.vocab_size >= 258 (and more for this corpus)")
    return f"could not train a {vocab_size}-token tokenizer on {chars:,} characters ({message})"


def _chunks(doc: str) -> list[str]:
    """`doc` cut at line ends into pieces of at most _CHUNK_CHARS characters (overlong lines are split)."""
    out, cur = [], ""
    for line in doc.splitlines(keepends=True):
        for i in range(0, len(line), _CHUNK_CHARS):
            piece = line[i:i + _CHUNK_CHARS]
            if len(cur) + len(piece) > _CHUNK_CHARS:
                out.append(cur)
                cur = ""
            cur += piece
    return out + [cur] if cur else out


# ------------------------------------------------------------------------------------- indexed dataset

class IndexedDataset:
    """Memory-mapped `<prefix>.bin` + `<prefix>.idx`. len() = documents; sizes, offsets: int64 [docs] in tokens;
    tokens: the flat memmap; doc(i) -> tokens of document i (EOS included); span(start, n) -> n tokens of
    the concatenation of all documents from token `start` (one slice, across document boundaries)."""

    def __init__(self, prefix):
        self.idx_path, self.bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise DataError(p, "missing")
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise DataError(self.idx_path, "truncated header")
        magic, version, code, n = _HEADER.unpack(head)
        if magic != _MAGIC:
            raise DataError(self.idx_path, f"bad magic {magic!r}, expected {_MAGIC!r}")
        if version != _VERSION or code not in _DTYPES:
            raise DataError(self.idx_path, f"format version {version} / dtype code {code} not supported "
                            f"(expected version {_VERSION}, dtype codes {sorted(_DTYPES)})")
        if n == 0 or self.idx_path.stat().st_size != _HEADER.size + 16 * n:
            raise DataError(self.idx_path, f"{self.idx_path.stat().st_size} bytes, inconsistent with its header "
                            f"({n} documents): truncated or corrupt")
        # mapped, not read: the ranks of a node share one copy in the page cache (16 bytes a document: 0.48 GB for
        # 30M documents, which each rank held before); checked a block at a time (no temporary of the whole)
        arrays = np.memmap(self.idx_path, np.int64, "r", offset=_HEADER.size, shape=(2, n))
        self.sizes, self.offsets = arrays[0], arrays[1]
        if not _consistent(self.sizes, self.offsets):
            raise DataError(self.idx_path, "document sizes and offsets are inconsistent: corrupt")
        self.dtype = np.dtype(_DTYPES[code])
        self.num_tokens = int(self.offsets[-1] + self.sizes[-1])
        expected = self.num_tokens * self.dtype.itemsize
        if self.bin_path.stat().st_size != expected:
            raise DataError(self.bin_path, f"{self.bin_path.stat().st_size} bytes, but {self.idx_path.name} "
                            f"describes {self.num_tokens} {self.dtype} tokens ({expected} bytes): truncated or stale")
        self.tokens = np.memmap(self.bin_path, self.dtype, "r")

    def __len__(self) -> int:
        return len(self.sizes)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i] + self.sizes[i]]

    def span(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start:start + length]

    @functools.cached_property
    def fingerprint(self) -> str:
        """tokens_fingerprint of its files, read once: open_checked compares it with meta.json's, and
        dataset.data_identity records it in each checkpoint."""
        return tokens_fingerprint(self.bin_path, self.idx_path)


FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK = 64, 1 << 16       # (4 MiB read at most, a file of any size)


def fingerprint(path) -> str:
    """sha256 of a file's size and of FINGERPRINT_BLOCKS blocks of FINGERPRINT_BLOCK bytes spread evenly over it, the
    first and the last among them (the whole file where it is no larger): tokens.bin or .idx of other content but the
    same size (another build copied over a directory, or a preparation killed between them and meta.json) differs in
    its blocks, and is seen without reading the file (a change confined to the bytes between blocks is not)."""
    size = os.path.getsize(path)
    whole = size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK
    starts = [0] if whole else [i * (size - FINGERPRINT_BLOCK) // (FINGERPRINT_BLOCKS - 1)
                                for i in range(FINGERPRINT_BLOCKS)]
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for start in starts:
            f.seek(start)
            digest.update(f.read(size if whole else FINGERPRINT_BLOCK))
    return digest.hexdigest()


def tokens_fingerprint(bin_path, idx_path) -> str:
    """sha256 of the fingerprints of tokens.bin and tokens.idx, together: what the samples are cut from, which the
    corpus sha256 and token count of meta.json do not pin (the files may be replaced without it). meta.json records
    it (prepare), and so does each checkpoint (dataset.data_identity)."""
    return hashlib.sha256((fingerprint(bin_path) + fingerprint(idx_path)).encode()).hexdigest()


def _consistent(sizes: np.ndarray, offsets: np.ndarray) -> bool:
    """sizes >= 1, offsets[0] = 0 and offsets[i + 1] = offsets[i] + sizes[i], checked _CHECK_DOCS at a time."""
    n = len(sizes)
    for i in range(0, n, _CHECK_DOCS):
        block = sizes[i:i + _CHECK_DOCS]
        if block.min() < 1 or (np.diff(offsets[i:i + _CHECK_DOCS + 1]) != block[:n - 1 - i]).any():
            return False
    return offsets[0] == 0


def write_indexed(prefix, docs, dtype) -> tuple[int, int]:
    """Write an iterable of token arrays (one per document, EOS included) as <prefix>.bin/.idx.
    Returns (documents, tokens)."""
    code = {np.dtype(v): k for k, v in _DTYPES.items()}[np.dtype(dtype)]
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    tmp = Path(temporary_name(bin_path))
    sizes = array("q")                  # (8 bytes a document, not a list's 36: 100M documents held 4.6 GB)
    try:
        with open(tmp, "wb") as f:
            for arr in docs:
                f.write(np.ascontiguousarray(arr, dtype))
                sizes.append(len(arr))
            f.flush()
            os.fsync(f.fileno())        # (on disk before the rename: a crash then leaves the old file or the new)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sizes = np.frombuffer(sizes, np.int64)
    offsets = np.cumsum(sizes)
    offsets -= sizes
    os.replace(tmp, bin_path)
    atomic_write(idx_path, [_HEADER.pack(_MAGIC, _VERSION, code, len(sizes)), sizes, offsets])
    return len(sizes), int(sizes.sum())


_worker: dict = {}   # this process's encoder state, set by _init_worker (in each pool worker, or in-process)


def _init_worker(model_path: str, dtype) -> None:
    _worker.update(sp=spm.SentencePieceProcessor(model_file=model_path), dtype=dtype)


def _init_pool_worker(parent: int, model_path: str, dtype) -> None:
    """A pool worker's _init_worker. It dies with its parent (`parent`, its pid): a pool's workers outlive a parent
    that is killed (SIGKILL), waiting forever for work. It starts with the stopping signals blocked (it was started
    within launch.signals_held); it ignores SIGINT and SIGHUP, which a terminal's Ctrl-C or hangup sends to the
    whole process group (the parent stops and ends the pool: a worker that died of one first would be "an encoding
    process died" and a traceback), and takes SIGTERM again, by which a broken pool ends its other workers."""
    if not signal_at_parent_death(signal.SIGKILL, parent):
        os._exit(1)
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)         # (a pending one is dropped)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)
    _init_worker(model_path, dtype)


def _encode_batch(texts: list[str], ends: list[bool]) -> list[np.ndarray]:
    """The token ids of each text, EOS appended where `ends` says it is a document's last piece (_pieces)."""
    sp = _worker["sp"]
    return [np.array(ids + [sp.eos_id()] * end, _worker["dtype"])
            for ids, end in zip(sp.encode(texts, num_threads=1), ends)]


def plain_bpe(tok: Tokenizer):
    """`tok`'s sentencepiece ModelProto where it is a BPE of train_tokenizer's kind (no normalisation map, no dummy
    prefix, whitespace kept and read as U+2581 before what follows), else why not (a str): a model of other settings
    (a given data.tokenizer), or no protobuf to read them with: none, or one older than the one sentencepiece's
    model code was generated with, which refuses it (sentencepiece 0.2.3: protobuf 7.36.1)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except Exception as e:      # ImportError; protobuf's VersionError (an Exception), e.g. from protobuf 5 or 6
        return f"its settings cannot be read without protobuf, a version sentencepiece accepts ({e})"
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.data)
    norm, spec = proto.normalizer_spec, proto.trainer_spec
    if (spec.model_type != spec.BPE or norm.precompiled_charsmap or norm.add_dummy_prefix
            or norm.remove_extra_whitespaces or not norm.escape_whitespaces or spec.treat_whitespace_as_suffix):
        return "a sentencepiece model of other settings than a BPE that reads each character alone"
    return proto


def inner_pairs(tok: Tokenizer) -> frozenset[str] | None:
    """The two-character strings inside some piece of `tok` (" " as U+2581): a text cut between two characters that
    form none of them is encoded as its two parts are, one after the other, by a sentencepiece BPE whose
    normalisation reads each character alone (plain_bpe) and whose unknown characters are bytes (byte fallback).
    Its encoding merges adjacent symbols into a piece of the vocabulary, so no symbol ever spans such a cut, and the
    merges on either side do not depend on the other. None for a model of other settings (a given data.tokenizer),
    or where protobuf, which reads them, is missing: its documents are encoded whole."""
    proto = plain_bpe(tok)
    if isinstance(proto, str) or not proto.trainer_spec.byte_fallback:
        return None                 # (without byte fallback, a run of unknown characters is one <unk>: not cut)
    Piece = proto.SentencePiece
    kinds = (Piece.NORMAL, Piece.USER_DEFINED, Piece.UNUSED)        # (what text can become: not bytes, controls)
    return frozenset(p.piece[k:k + 2] for p in proto.pieces if p.type in kinds for k in range(len(p.piece) - 1))


def _pieces(doc: str, inner: frozenset[str] | None, size: int):
    """(piece, whether it is the last) of `doc`, cut after about every `size` characters at the first point from there
    between two characters that make no pair of `inner` (inner_pairs: the pieces encode as `doc` does); `doc` whole
    where it is no longer or `inner` is None. sentencepiece holds ~40 bytes per character of a text it encodes, and
    its ids a Python int each: a 100 MB document (a .txt file) took 6 GB, one process, 5x slower than short ones."""
    start = 0
    while inner is not None and len(doc) - start > size:
        cut = start + size
        while cut < len(doc) and doc[cut - 1:cut + 1].replace(" ", SPACE_SYMBOL) in inner:
            cut += 1
        if cut == len(doc):
            break
        yield doc[start:cut], False
        start = cut
    yield doc[start:] if start else doc, True


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits, else int32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def encode_corpus(docs, tokenizer: Tokenizer, prefix, num_workers: int, num_docs: int) -> tuple[int, int]:
    """Encode the `num_docs` documents of `docs` (any iterable: read as they are encoded) with `num_workers`
    processes, EOS appended to each, into <prefix>.bin/.idx, showing a progress bar and printing tokens/s. Batches of
    _BATCH_CHARS characters, at most 2 x num_workers of them in flight, so memory does not grow with the corpus; a
    document longer than _PIECE_CHARS is encoded in pieces (_pieces: the same tokens), spread over the workers.
    Returns (documents, tokens)."""
    dtype = token_dtype(tokenizer.vocab_size)
    progress, t0, done = _Progress(num_docs), time.time(), [0, 0]
    inner = inner_pairs(tokenizer)

    def batches():
        """([texts], [whether each ends its document]) of about _BATCH_CHARS characters each."""
        texts, ends, chars = [], [], 0
        for d in docs:
            for piece, end in _pieces(d, inner, _PIECE_CHARS):
                if chars >= _BATCH_CHARS:
                    yield texts, ends
                    texts, ends, chars = [], [], 0
                texts.append(piece)
                ends.append(end)
                chars += len(piece)
        if texts:
            yield texts, ends

    def encoded(submit):
        """Each document's token array, in order, with batches submitted ahead while earlier ones are written."""
        pending, parts = collections.deque(), []
        for batch in batches():
            pending.append((submit(batch), batch[1]))
            if len(pending) >= 2 * num_workers:
                yield from written(*pending.popleft(), parts)
        while pending:
            yield from written(*pending.popleft(), parts)

    def written(future, ends, parts):
        """The documents that the batch's pieces end, joined to their earlier pieces (`parts`, kept across batches)."""
        for a, end in zip(future.result(), ends):
            parts.append(a)
            if end:
                a = parts[0] if len(parts) == 1 else np.concatenate(parts)
                parts.clear()
                done[0], done[1] = done[0] + 1, done[1] + len(a)
                yield a
        progress(*done)

    init = (str(tokenizer.path), dtype)
    if num_workers > 1:
        # (a worker that dies, killed or failing its initializer, breaks the pool: BrokenProcessPool, not a hang;
        # held: the pool starts multiprocessing's resource tracker, which must not die of a SIGHUP to the group)
        with signals_held():
            pool = ProcessPoolExecutor(num_workers, multiprocessing.get_context("spawn"), _init_pool_worker,
                                       (os.getpid(), *init))

        def submit(batch):
            # (a Stopped, launch.stop_on_signals, raised in the pool's bookkeeping could leave its shutdown waiting
            # forever; the workers it starts here inherit the signals' block: _init_pool_worker)
            with signals_held():
                return pool.submit(_encode_batch, *batch)
        try:
            n_docs, n_tokens = write_indexed(prefix, encoded(submit), dtype)
        except BrokenProcessPool as e:
            raise DataError(f"{prefix}.bin", f"an encoding process died ({e}); out of memory? try data.num_workers=1",
                            rebuild=None) from None
        finally:
            with signals_held():                 # (a second signal: after the pool is ended)
                pool.shutdown(cancel_futures=True)
    else:
        _init_worker(*init)
        n_docs, n_tokens = write_indexed(prefix, encoded(lambda b: _Done(_encode_batch(*b))), dtype)
    progress(*done, final=True)
    dt = time.time() - t0
    print(f"encoded {n_docs:,} document{'s' * (n_docs != 1)}, {n_tokens:,} tokens in {dt:.1f} s "
          f"({n_tokens / dt:,.0f} tokens/s, {num_workers} workers) -> {prefix}.bin ({np.dtype(dtype)})")
    return n_docs, n_tokens


class _Done:
    """An in-process batch's result, as a Future gives it."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class _Progress:
    """A one-line progress bar on stderr (redrawn on a terminal, only the final line otherwise)."""

    def __init__(self, total: int):
        self.total, self.t0, self.last = total, time.time(), 0.0

    def __call__(self, docs: int, tokens: int, final: bool = False) -> None:
        now = time.time()
        if not final and (now - self.last < 0.2 or not sys.stderr.isatty()):
            return
        self.last, frac = now, docs / self.total
        sys.stdout.flush()
        sys.stderr.write(f"\rencode [{'#' * int(30 * frac):<30}] {frac:4.0%} {docs}/{self.total} docs "
                         f"{tokens / max(now - self.t0, 1e-9) / 1e6:.2f}M tokens/s" + ("\n" if final else ""))
        sys.stderr.flush()


# ------------------------------------------------------------------------------------------ preparation

def prepare(cfg: DataConfig) -> dict:
    """corpus -> tokenizer -> tokens.bin/.idx + meta.json in cfg.dir; a step whose output exists and matches
    (corpus hash, vocab size, tokenizer sha256) is skipped, and a valid build of another corpus or vocabulary
    is refused (_refuse_other_data). Returns the contents of meta.json. A data.dir that cannot be created or
    written is refused first; a refused build leaves no empty data.dir (nor parents) that it created. One
    preparation at a time builds a directory (its .lock, while it runs: another waits for it); it first removes the
    temporary files a killed one left (tokens.bin.tmp<pid>, the size of the corpus)."""
    out = Path(cfg.dir)
    if (problem := unwritable_dir(out)) is not None:
        raise DataError(f"data.dir={cfg.dir}", f"{problem}; choose another data.dir", rebuild=None)
    given = _given_tokenizer(cfg)
    existing = existing_part(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with DirectoryLock(out, "another preparation", waiting=lambda holder: print(
                f"{out} is being prepared by another process ({holder}): waiting for it to finish", flush=True)):
            held = _held_build(out)                  # (what the other built too; opened once, for both)
            _refuse_other_data(cfg, out, given, held)
            for name, size in remove_left_temporaries(out, _FILES):
                print(f"removed {out / name} ({size:,} bytes), left by a preparation that was killed")
            return _build(cfg, out, given, held)
    except BaseException:
        remove_empty_dirs(out, existing)
        raise


def _build(cfg: DataConfig, out: Path, given: Tokenizer | None, held: tuple | None) -> dict:
    """prepare()'s work in the directory `out`, which exists (`given`: data.tokenizer's; `held`: the valid build
    there, _held_build's). Where `out` holds a build's files and they are encoded again, one line says why."""
    t0 = time.time()
    docs, info = read_corpus(cfg.source, cfg.text_key)
    left_out = [f"{docs.empty:,} empty document{'s' * (docs.empty != 1)}"] * bool(docs.empty) + [
        f"{len(docs.ignored):,} file{'s' * (len(docs.ignored) != 1)} neither .txt nor .jsonl(.gz) "
        f"({', '.join(sorted({p.suffix or p.name for p in docs.ignored})[:5])})"] * bool(docs.ignored)
    python = f"python {info['python']}, " if cfg.source == "stdlib" else ""        # (the corpus it reads)
    docs_text = f"{info['num_docs']:,} document{'s' * (info['num_docs'] != 1)}"
    print(f"corpus: {docs_text}, {info['num_chars']:,} characters from {info['source']} "
          f"({python}sha256 {info['corpus_sha256'][:12]}){'; left out: ' + ', '.join(left_out) if left_out else ''}")
    if held and held[2].get("corpus_sha256") != info["corpus_sha256"]:
        if is_superseded_build(out, held[2]["corpus_sha256"]):
            print(f"{out} is a build kept for the corpus as it read before (sha256 {held[2]['corpus_sha256'][:12]}): "
                  f"read as it is, not built again")
            return held[2]
        _keep_superseded(cfg, out, held[2]["corpus_sha256"])
    spaced, first = docs.spaced
    if spaced:
        print(f"note: {spaced:,} document{'s hold' if spaced != 1 else ' holds'} U+2581 ('{SPACE_SYMBOL}', the first "
              f"in {first}): sentencepiece's whitespace symbol, which it encodes as a space (the model sees a space)")
    tok_path = out / "tokenizer.model"
    trained_on = {"vocab_size": cfg.vocab_size, "sample_chars": cfg.tokenizer_sample_chars,
                  "seed": cfg.tokenizer_seed, "corpus_sha256": info["corpus_sha256"], "settings": _TOKENIZER_SETTINGS}
    try:
        tok = Tokenizer(tok_path)
        cached = read_json(out / "tokenizer.json") == {**trained_on, "sha256": tok.sha256}
    except DataError:
        cached = False
    if given:
        tok = _copy_tokenizer(given, tok_path)
    elif cached:
        print(f"tokenizer: cached {tok_path}")
    else:
        t = time.time()
        train_tokenizer(docs, cfg.vocab_size, cfg.tokenizer_sample_chars, cfg.tokenizer_seed, tok_path, trained_on)
        tok = Tokenizer(tok_path)
        print(f"tokenizer: trained {tok_path} ({tok.vocab_size} tokens) in {time.time() - t:.1f} s")
    ds, meta, why = _encoded(out, tok, held, info)
    if meta is not None:
        print(f"tokens: cached {out / 'tokens.bin'} ({meta['num_tokens']:,} tokens)")
        if "tokens_fingerprint" not in meta:         # (a build of before meta.json recorded it: recorded now)
            meta["tokens_fingerprint"] = ds.fingerprint
            atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())
    else:
        if why:
            print(f"tokens: encoding the corpus again, {why}")
        n_docs, n_tokens = encode_corpus(docs, tok, out / "tokens", cfg.num_workers, info["num_docs"])
        meta = {**info, "num_docs": n_docs, "num_tokens": n_tokens, "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id, "tokenizer_sha256": tok.sha256, "dtype": str(token_dtype(tok.vocab_size)),
                "tokens_fingerprint": tokens_fingerprint(out / "tokens.bin", out / "tokens.idx")}
        atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())     # (last: it vouches for the rest)
    print(f"data ready in {out} ({time.time() - t0:.1f} s)")
    return meta


def _encoded(out: Path, tok: Tokenizer, held: tuple | None, info: dict) -> tuple:
    """(dataset, meta.json, None) of the tokens in `out` where they are the corpus `info` (read_corpus's) encoded
    with `tok`: `held` (_held_build's) where it is of `tok`, else `out` opened again (a tokenizer.model missing or
    broken there, trained again: its tokens may be of the same one). Else (None, None, why they are not: first a
    corpus that reads otherwise; None where `out` holds none of a build's tokens.bin, tokens.idx, meta.json)."""
    now = (info["corpus_sha256"], info["source"])
    found = held
    if held is None or held[0].sha256 != tok.sha256 and _corpus_of(held[2]) == now:
        try:
            found = (tok, *open_checked(out, tok))
        except DataError as e:
            there = any((out / name).exists() for name in ("tokens.bin", "tokens.idx", "meta.json"))
            return None, None, f"{e.what}: {e.problem}" if there else None
    _, ds, meta = found
    if _corpus_of(meta) != now:
        sha, source = _corpus_of(meta)
        return None, None, (f"{out / 'meta.json'}: its tokens are of the corpus {source} as it read before (sha256 "
                            f"{str(sha)[:12]}), which now reads {info['corpus_sha256'][:12]}")
    return ds, meta, None


def _corpus_of(meta: dict) -> tuple:
    """(corpus sha256, source) of a build's meta.json."""
    return meta.get("corpus_sha256"), meta.get("source")


def _given_tokenizer(cfg: DataConfig) -> Tokenizer | None:
    """data.tokenizer's tokenizer (None without one), checked before the corpus is read: it exists, is one, has
    data.vocab_size tokens and an EOS (encode_corpus ends each document with it)."""
    if not cfg.tokenizer:
        return None
    try:
        given = Tokenizer(cfg.tokenizer)
    except DataError as e:
        raise DataError(f"data.tokenizer={cfg.tokenizer}", e.problem, rebuild=None) from None
    if given.vocab_size != cfg.vocab_size:
        raise DataError(f"data.tokenizer={cfg.tokenizer}", f"has {given.vocab_size} tokens, but data.vocab_size="
                        f"{cfg.vocab_size}; set data.vocab_size={given.vocab_size}", rebuild=None)
    if given.eos_id < 0:             # (its -1 overflowed a uint16 tokens.bin, or became an id outside the vocabulary)
        raise DataError(f"data.tokenizer={cfg.tokenizer}", "has no EOS piece (eos_id -1), which ends each document "
                        "in tokens.bin; give a sentencepiece model trained with an eos_id, or leave data.tokenizer "
                        "out to train one", rebuild=None)
    return given


def _copy_tokenizer(given: Tokenizer, tok_path: Path) -> Tokenizer:
    """`given` (data.tokenizer) copied to `tok_path`, the directory's own, for a corpus encoded with the tokenizer of
    other data: another run's, whose checkpoints init_from then reads (a token id means the same text); recorded in
    tokenizer.json (`given`), so that no later prepare of the directory trains another over it."""
    if not tok_path.is_file() or hashlib.sha256(tok_path.read_bytes()).hexdigest() != given.sha256:
        atomic_write(tok_path, given.data)             # (the bytes checked: not the file again, changed since)
    atomic_write(tok_path.with_suffix(".json"), json.dumps({"given": str(given.path.resolve()),
                                                            "sha256": given.sha256}, indent=1).encode())
    print(f"tokenizer: {tok_path}, a copy of {given.path} ({given.vocab_size} tokens, sha256 {given.sha256[:12]})")
    return Tokenizer(tok_path)


def _held_build(out: Path) -> tuple[Tokenizer, IndexedDataset, dict] | None:
    """(tokenizer, dataset, meta.json) of the valid build in `out`, or None (no build, or a broken or partial one)."""
    try:
        tok = Tokenizer(out / "tokenizer.model")
        return tok, *open_checked(out, tok)
    except DataError:
        return None


def _keep_superseded(cfg: DataConfig, out: Path, corpus_sha256: str) -> None:
    """Before prepare() builds `out` again for its corpus as it now reads (files that changed, another Python's
    standard library, another version's reading), the valid build there, which runs and their checkpoints may read,
    is kept as hard links in `{out}.superseded-<its corpus sha256[:12]>`: the new build replaces each file by rename,
    so the links keep the old files, and no byte is copied (a kept build is never built again itself: _build). Where
    the file system takes no links: a DataError, the build left as it is and no directory made."""
    keep = superseded_build(out, corpus_sha256)
    made = not os.path.lexists(keep)
    try:
        keep.mkdir(exist_ok=True)
        remove_left_temporaries(keep, _FILES)
        for name in _FILES:
            src, dst = out / name, keep / name
            if not src.exists():
                dst.unlink(missing_ok=True)
            elif not (dst.exists() and os.path.samefile(src, dst)):
                tmp = temporary_name(dst)
                os.link(src, tmp)
                os.replace(tmp, dst)
    except OSError as e:
        if made:
            shutil.rmtree(keep, ignore_errors=True)
        raise DataError(out / "meta.json", f"is a valid build of the corpus as it read before (sha256 "
                        f"{corpus_sha256[:12]}), which runs may read, and it could not be kept beside the new one as "
                        f"hard links in {keep} ({e.strerror or e}); prepare into another data.dir (to rebuild "
                        f"{cfg.dir} itself, remove it first)", rebuild=None) from None
    print(f"kept the build of the corpus as it read before (sha256 {corpus_sha256[:12]}) in {keep}, for the runs "
          f"that read it (data.dir={keep}); remove it when none does")


def _refuse_other_data(cfg: DataConfig, out: Path, given: Tokenizer | None, held: tuple | None) -> None:
    """prepare() rebuilds a directory in place for its own source and vocabulary (a corpus that changed,
    another Python's standard library: the valid build it replaces kept, _keep_superseded; a broken or partial
    build), never over a valid build of another corpus, text_key or vocabulary (check_holds): runs and their
    checkpoints may read it (data.dir's default names only the vocabulary); nor, over a valid build, another
    tokenizer than data.tokenizer's (`given`), a trained one over a given one, or one trained with other tokenizer_*
    settings (the build's token ids then mean what another data's checkpoints were trained on). `held`: the valid
    build in `out` (_held_build), or None."""
    if held is None:
        return
    tok, _, meta = held
    check_holds(cfg, tok, meta, {"data.vocab_size": cfg.vocab_size}, training=False, given=given)
    record = read_json(out / "tokenizer.json") or {}
    recorded = record.get("given")
    remove = f"(to rebuild {cfg.dir} itself, remove it first)"
    own = not given and record.get("sha256") == tok.sha256              # (its record: a tokenizer trained here)
    settings = {f"tokenizer_{k}": record[k] for k in ("sample_chars", "seed") if k in record and own}
    if any(getattr(cfg, key) != was for key, was in settings.items()):     # (retraining it: other token ids)
        asked = {key: getattr(cfg, key) for key in settings}
        what = "a tokenizer trained with " + ", ".join(f"data.{k}={v}" for k, v in asked.items())
        was = " ".join(f"data.{k}={v}" for k, v in settings.items())
        raise DataError(tok.path, f"was trained with {was.replace(' ', ', ')}, in a valid build that runs may read; "
                        f"give {was} to prepare it again, or: {new_dir_hint(cfg, what, **asked)} {remove}",
                        rebuild=None)
    if recorded and not given:
        raise DataError(tok.path, f"is a copy of {recorded} (data.tokenizer), in a valid build that runs may read; "
                        f"give data.tokenizer={recorded} to prepare it again, or train a tokenizer of its own in "
                        f"another data.dir {remove}", rebuild=None)


def check_holds(cfg: DataConfig, tok: Tokenizer, meta: dict, vocab_sizes: dict, training: bool,
                given: Tokenizer | None = None) -> None:
    """A valid directory (its tokenizer and meta.json) must hold cfg.source's corpus (of its JSON lines, the
    data.text_key field), a vocabulary of each of vocab_sizes ({key: size}) and data.tokenizer's tokenizer where
    one is given (train.py reads the directory's own: it may stand for a given file since removed, which its
    tokenizer.json records). Else one DataError that leaves it as it is, names the
    command that builds the asked-for data beside it, and how else to go on: train on what it holds (`training`),
    or remove it to rebuild it in place (prepare). `given`: data.tokenizer's, where the caller has read it."""
    def refuse(path, problem: str, keys: str, hint: str):
        other = f"set {keys} to train on it, or: " if training else ""
        remove = "" if training else f" (to rebuild {cfg.dir} itself, remove it first)"
        raise DataError(path, f"{problem}; {other}{hint}{remove}", rebuild=None)

    held = meta.get("source")
    if held != source_id(cfg.source):
        refuse(Path(cfg.dir) / "meta.json", f"holds the corpus {held}, but data.source={cfg.source}",
               f"data.source={held}", new_dir_hint(cfg, f"data.source={cfg.source}"))
    key = meta.get("text_key")            # (recorded where the corpus has JSON lines)
    if key is not None and key != cfg.text_key:
        refuse(Path(cfg.dir) / "meta.json", f"holds the \"{key}\" field of its JSON lines, but data.text_key="
               f"{cfg.text_key}", f"data.text_key={key}",
               new_dir_hint(cfg, f"their \"{cfg.text_key}\" field", text_key=cfg.text_key))
    wrong = {key: want for key, want in vocab_sizes.items() if want != tok.vocab_size}
    if wrong:
        # each key that differs, as key=N: model.vocab_size follows data.vocab_size only where a preset interpolates
        # it, not where it is given (bloom-176b's preset, model.vocab_size=...), which this check cannot tell apart
        want = next(iter(wrong.values()))          # (a new build of data.vocab_size's, else model.vocab_size's)
        model = tuple(f"{k}={want}" for k, v in vocab_sizes.items() if k != "data.vocab_size" and v != want)
        refuse(tok.path, f"has {tok.vocab_size} tokens, but {' and '.join(f'{k}={v}' for k, v in wrong.items())}",
               " ".join(f"{k}={tok.vocab_size}" for k in wrong),
               new_dir_hint(cfg, f"a {want}-token vocabulary", run_also=model, vocab_size=want))
    if not cfg.tokenizer:
        return
    if given is None and not (training and _copy_stands_in(cfg, tok)):
        given = _given_tokenizer(cfg)
    if given and given.sha256 != tok.sha256:
        refuse(tok.path, f"is another tokenizer (sha256 {tok.sha256[:12]}) than data.tokenizer={cfg.tokenizer} "
               f"({given.sha256[:12]})" + ("" if training else ", in a valid build that runs may read"),
               "data.tokenizer to it (or leave it out)",
               f"prepare this corpus with data.tokenizer={cfg.tokenizer} in another data.dir")


def _copy_stands_in(cfg: DataConfig, tok: Tokenizer) -> bool:
    """Whether data.tokenizer is a file removed since cfg.dir's tokenizer `tok` was copied from it (tokenizer.json
    records the copy: _copy_tokenizer), which the copy then stands for."""
    record = read_json(Path(cfg.dir) / "tokenizer.json") or {}
    return not Path(cfg.tokenizer).exists() and record.get("given") == os.path.realpath(cfg.tokenizer) and \
        record.get("sha256") == tok.sha256


def open_checked(out: Path, tok: Tokenizer) -> tuple[IndexedDataset, dict]:
    """The dataset in `out`, checked against its meta.json and the tokenizer that must have encoded it: its token
    files must be those meta.json was written for (its tokens_fingerprint, where it records one: a build of before
    it does not, and is read as before)."""
    meta = read_json(out / "meta.json")
    if not isinstance(meta, dict):
        raise DataError(out / "meta.json", "missing or not valid JSON")
    if not isinstance(meta.get("source"), str):    # (every build records it: check_holds read "the corpus None")
        raise DataError(out / "meta.json", "names no source corpus: damaged")
    ds = IndexedDataset(out / "tokens")
    if meta.get("tokenizer_sha256") != tok.sha256:
        raise DataError(ds.bin_path, f"encoded with another tokenizer (sha256 {str(meta.get('tokenizer_sha256'))[:12]} "
                        f"in meta.json, {tok.path} has {tok.sha256[:12]})")
    if (meta.get("num_docs"), meta.get("num_tokens")) != (len(ds), ds.num_tokens):
        raise DataError(out / "meta.json", f"says {meta.get('num_docs')} documents / {meta.get('num_tokens')} tokens, "
                        f"{ds.idx_path.name} has {len(ds)} / {ds.num_tokens}")
    recorded = meta.get("tokens_fingerprint")
    if recorded is not None and recorded != ds.fingerprint:
        raise DataError(out, f"its tokens.bin and tokens.idx are not the files its meta.json was written for "
                        f"(tokens_fingerprint {ds.fingerprint[:12]}, meta.json's {str(recorded)[:12]}): another "
                        f"build's copied over them, or a preparation stopped before it wrote meta.json")
    return ds, meta


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
