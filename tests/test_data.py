"""Data pipeline: tokenizer, indexed dataset, validation errors, global sample order, caching.

One small corpus (40 standard-library modules as .txt, tests/corpus.py; vocab 512) is prepared once per module.
"""
import dataclasses
import json
import os
import platform
import random
import re
import shutil
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from corpus import write_modules
from megatron_mini import data
from megatron_mini.config import DataConfig
from megatron_mini.data import (DataError, IndexedDataset, Tokenizer, encode_corpus, prepare, read_corpus,
                                train_tokenizer)
from megatron_mini.dataset import (epoch_order, get_batch, load_datasets, load_eval_sets, rebuild_command,
                                   split_documents)
from megatron_mini.training import evaluation_note

VOCAB, SEQ = 512, 32


def make_text_corpus(out_dir: Path, num_files: int) -> Path:
    """The first `num_files` standard-library modules of 4-40 kB (tests/corpus.py), as .txt (sorted by name)."""
    return write_modules(out_dir, slice(num_files), sizes=(4_000, 40_000))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    cfg = DataConfig(source=str(make_text_corpus(root / "corpus", 40)), dir=str(root / "out"), vocab_size=VOCAB,
                     val_fraction=0.1, num_workers=2)
    return cfg, prepare(cfg)


@pytest.fixture
def copy_of(prepared, tmp_path):
    """A fresh copy of the prepared data dir and a config pointing at it."""
    cfg, _ = prepared
    shutil.copytree(cfg.dir, tmp_path / "out")
    return DataConfig(**{**vars(cfg), "dir": str(tmp_path / "out")})


def test_tokenizer_round_trip_and_newline_piece(prepared):
    cfg, meta = prepared
    tok = Tokenizer(Path(cfg.dir) / "tokenizer.model")
    assert (tok.vocab_size, tok.eos_id, tok.sha256) == (VOCAB, meta["eos_id"], meta["tokenizer_sha256"])
    texts = ["def f(x):\n    return x + 1\n", "\tif a:\n\t\tb = 'é 🙂 ñ'\r\n", "x = 1234567890\n\n\n",
             "  \n \t\n", ""]
    for s in texts:
        assert tok.decode(tok.encode(s)) == s
    sp = spm.SentencePieceProcessor(model_file=str(tok.path))
    ids = tok.encode("a\nb")
    assert not any(sp.is_byte(i) for i in ids) and sp.piece_to_id("\n") in ids
    assert [sp.id_to_piece(i) for i in tok.encode("2024")] == list("2024")   # digits are split


def test_dataset_round_trip(prepared):
    cfg, meta = prepared
    tok = Tokenizer(Path(cfg.dir) / "tokenizer.model")
    docs, info = read_corpus(cfg.source)
    docs = list(docs)
    ds = IndexedDataset(Path(cfg.dir) / "tokens")
    assert len(ds) == len(docs) == meta["num_docs"] and ds.dtype == np.uint16
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.doc(i), tok.encode(d) + [tok.eos_id])
    assert ds.num_tokens == meta["num_tokens"] == int(ds.sizes.sum())
    np.testing.assert_array_equal(ds.span(int(ds.offsets[1]) - 3, 6), np.concatenate([ds.doc(0)[-3:], ds.doc(1)[:3]]))
    assert meta["corpus_sha256"] == info["corpus_sha256"] and meta["python"] == info["python"]


def test_a_fingerprint_reads_64_blocks_of_a_large_file_and_all_of_a_small_one(tmp_path, monkeypatch):
    """data.fingerprint: the same bytes, the same fingerprint; a byte changed in the first, a middle or the last of its
    64 blocks of 64 KiB, or one byte more, another; a file of at most 4 MiB is read whole (any byte counts), a larger
    one 4 MiB of it, whatever its size."""
    size = data.FINGERPRINT_BLOCKS * data.FINGERPRINT_BLOCK + 12345
    raw = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    middle = 32 * (size - data.FINGERPRINT_BLOCK) // (data.FINGERPRINT_BLOCKS - 1)      # (block 33's first byte)
    path = tmp_path / "tokens.bin"

    def of(content: bytes) -> str:
        path.write_bytes(content)
        return data.fingerprint(path)

    def flipped(content: bytes, at: int) -> bytes:
        return content[:at] + bytes([content[at] ^ 1]) + content[at + 1:]
    base = of(raw)
    assert of(raw) == base and of(raw + b"x") != base
    for at in (0, middle + 5, size - 1):                  # in the first, the 33rd and the last block
        assert of(flipped(raw, at)) != base, at
    read = []
    monkeypatch.setattr(data, "open", lambda *a, **k: _Counted(open(*a, **k), read), raising=False)
    data.fingerprint(path)
    assert sum(read) == data.FINGERPRINT_BLOCKS * data.FINGERPRINT_BLOCK
    monkeypatch.undo()
    small = raw[:data.FINGERPRINT_BLOCKS * data.FINGERPRINT_BLOCK]
    assert of(flipped(small, len(small) // 2 + 7)) != of(small)      # (between the blocks of a larger file)


class _Counted:
    """A file that adds the size of each read to `sizes`."""

    def __init__(self, f, sizes: list):
        self.f, self.sizes = f, sizes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def seek(self, at):
        return self.f.seek(at)

    def read(self, n=-1):
        out = self.f.read(n)
        self.sizes.append(len(out))
        return out


def test_encoding_does_not_depend_on_workers(prepared, tmp_path):
    cfg, _ = prepared
    tok = Tokenizer(Path(cfg.dir) / "tokenizer.model")
    assert encode_corpus(read_corpus(cfg.source)[0], tok, tmp_path / "tokens", num_workers=1, num_docs=40)[0] == 40
    for ext in ("bin", "idx"):
        assert (tmp_path / f"tokens.{ext}").read_bytes() == (Path(cfg.dir) / f"tokens.{ext}").read_bytes()


def test_a_protobuf_sentencepiece_refuses_leaves_documents_whole(prepared, tmp_path, monkeypatch):
    """sentencepiece's model code refuses a protobuf older than the one it was generated with (0.2.3: 7.36.1) with
    protobuf's VersionError, not an ImportError (protobuf 5 or 6, as wandb 0.18 to 0.25 pin: the encoding raised
    it): the settings go unread, as without protobuf, and the documents are encoded whole, to the same tokens."""
    runtime = pytest.importorskip("google.protobuf.runtime_version")     # (protobuf >= 5.26: the check itself)
    cfg, _ = prepared
    tok = Tokenizer(Path(cfg.dir) / "tokenizer.model")
    monkeypatch.setattr(runtime, "MAJOR", 5)                             # the runtime says it is 5.29.5
    monkeypatch.setattr(runtime, "MINOR", 29)
    monkeypatch.setattr(runtime, "PATCH", 5)
    monkeypatch.delattr(spm, "sentencepiece_model_pb2", raising=False)  # (imported anew: its check runs)
    monkeypatch.delitem(sys.modules, "sentencepiece.sentencepiece_model_pb2", raising=False)
    with pytest.raises(runtime.VersionError):
        import sentencepiece.sentencepiece_model_pb2  # noqa: F401
    assert data.plain_bpe(tok).startswith("its settings cannot be read without protobuf") and "5.29.5" in \
        data.plain_bpe(tok)
    assert data.inner_pairs(tok) is None
    monkeypatch.setattr(data, "_PIECE_CHARS", 300, raising=False)
    assert encode_corpus(read_corpus(cfg.source)[0], tok, tmp_path / "whole", num_workers=1, num_docs=40)[0] == 40
    for ext in ("bin", "idx"):
        assert (tmp_path / f"whole.{ext}").read_bytes() == (Path(cfg.dir) / f"tokens.{ext}").read_bytes()


def test_a_long_document_is_encoded_in_pieces_to_the_same_tokens(prepared, tmp_path, monkeypatch):
    """A document longer than _PIECE_CHARS reaches sentencepiece in pieces of about that many characters (a 100 MB
    .txt took 6 GB encoded whole), cut where no piece of the vocabulary spans the cut: the same files, byte for byte,
    as each document encoded whole (at 1 and 2 workers: a document's pieces cross batches and workers)."""
    cfg, _ = prepared
    tok = Tokenizer(Path(cfg.dir) / "tokenizer.model")
    docs = list(read_corpus(cfg.source)[0])
    monkeypatch.setattr(data, "_PIECE_CHARS", 300, raising=False)
    lengths, init = [], data._init_worker

    def recorded(*args):                   # (the in-process encoder: the length of each text it is given)
        init(*args)
        sp = data._worker["sp"]
        encode = sp.encode
        data._worker["sp"] = type("Recorded", (), {"eos_id": sp.eos_id, "encode": lambda _, texts, **kw: (
            lengths.extend(map(len, texts)), encode(texts, **kw))[1]})()
    monkeypatch.setattr(data, "_init_worker", recorded)
    for workers in (1, 2):
        assert encode_corpus(docs, tok, tmp_path / f"w{workers}", num_workers=workers, num_docs=40)[0] == 40
        for ext in ("bin", "idx"):
            assert (tmp_path / f"w{workers}.{ext}").read_bytes() == (Path(cfg.dir) / f"tokens.{ext}").read_bytes()
    assert len(lengths) > sum(map(len, docs)) // 600 and max(lengths) < 600, (len(lengths), max(lengths))
    inner = data.inner_pairs(tok)
    spaces = " " * 1000                           # ("  " is inside a piece: no cut, the document whole)
    assert "  ".replace(" ", data.SPACE_SYMBOL) in inner and list(data._pieces(spaces, inner, 300)) == [(spaces, True)]
    model = tmp_path / "other.model"                  # (a given tokenizer without byte fallback: "☃☃" is one <unk>)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(model)[:-6], model_type="bpe",
                                   vocab_size=300, normalization_rule_name="identity", add_dummy_prefix=False,
                                   remove_extra_whitespaces=False, minloglevel=2)
    assert data.inner_pairs(Tokenizer(model)) is None


def test_reading_a_long_document_holds_two_copies_of_it(tmp_path):
    """A pass over a .txt corpus (one document) holds the file's bytes and its text, then the text and the UTF-8 it
    hashes: twice its size at its peak (traced), where the hash's input joined to its length was a third copy; the
    sha256 is the one every build has recorded."""
    import hashlib
    import tracemalloc

    text = "def f(x):\n    return x + 1\n" * 100_000
    (tmp_path / "one.txt").write_text(text)
    corpus = read_corpus(str(tmp_path / "one.txt"))[0]
    tracemalloc.start()
    try:
        assert list(corpus) == [text]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * len(text), peak / len(text)
    assert corpus.sha256 == hashlib.sha256(len(text).to_bytes(8, "little") + text.encode()).hexdigest()


def test_stdlib_and_jsonl_sources(tmp_path):
    docs, info = read_corpus("stdlib")
    docs = list(docs)
    assert info["num_docs"] == len(docs) > 500 and info["python"] == platform.python_version()
    assert read_corpus("stdlib")[1]["corpus_sha256"] == info["corpus_sha256"]
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one\\n"}\n\n{"text": "two"}\n')
    assert list(read_corpus(str(path))[0]) == ["one\n", "two"]
    for bad in ('{"body": "two"}', '{"text": 2}', 'not json'):
        path.write_text('{"text": "one"}\n' + bad + "\n")
        with pytest.raises(DataError, match=r"c\.jsonl:2: expected"):
            read_corpus(str(path))
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(DataError, match=f"data.source={bad}: "):
            read_corpus(str(bad))
    (tmp_path / "one.txt").write_text("a document")
    assert list(read_corpus(str(tmp_path / "one.txt"))[0]) == ["a document"]        # (a .txt file: one document)
    (tmp_path / "one.md").write_text("a document")
    with pytest.raises(DataError, match=r"one\.md: is a file but not a \.txt, \.jsonl or \.jsonl\.gz file; use "
                                        r"'stdlib', a \.jsonl \(or \.jsonl\.gz\) file with a \"text\" field per line, "
                                        r"a \.txt file, or a directory of such files"):
        read_corpus(str(tmp_path / "one.md"))


@pytest.mark.parametrize("sample_chars", [1, 50_000, 400_000, 10 ** 9])
def test_the_tokenizer_sample_is_the_shuffled_prefix_without_holding_the_corpus(prepared, sample_chars):
    """tokenizer_sample streams the corpus twice (chunk lengths, then the chosen chunks); its sample is the in-memory
    reference's, chunk for chunk: every chunk of every document, random.Random(seed).shuffle'd, up to the first at
    which they hold sample_chars characters (all of them where the corpus is smaller)."""
    corpus, info = read_corpus(prepared[0].source)
    chunks = [c for d in list(corpus) for c in data._chunks(d)]
    random.Random(77).shuffle(chunks)
    end = next((k + 1 for k in range(len(chunks)) if sum(map(len, chunks[:k + 1])) >= sample_chars), len(chunks))
    assert data.tokenizer_sample(corpus, sample_chars, 77) == chunks[:end]


def test_encoding_reads_the_corpus_only_a_few_batches_ahead(prepared, tmp_path, monkeypatch):
    """encode_corpus at 2 workers reads at most 2 x 2 batches beyond the documents written (it does not hold the
    corpus); the tokens are those of the in-process encoding."""
    cfg, _ = prepared
    tok = Tokenizer(Path(cfg.dir) / "tokenizer.model")
    doc = "x = 1\n" * (data._BATCH_CHARS // 4 // 6)          # 4 documents a batch
    read, lag, real = [0], [], data.write_indexed

    def docs():
        for _ in range(60):
            read[0] += 1
            yield doc

    def writing(prefix, arrays, dtype):
        def counted():
            for written, a in enumerate(arrays, 1):
                lag.append(read[0] - written)
                yield a
        return real(prefix, counted(), dtype)
    monkeypatch.setattr(data, "write_indexed", writing)
    assert encode_corpus(docs(), tok, tmp_path / "two", num_workers=2, num_docs=60) == (60, 60 * (len(tok.encode(doc))
                                                                                                 + 1))
    assert 0 <= max(lag) <= (2 * 2 + 1) * 4, max(lag)
    encode_corpus([doc] * 60, tok, tmp_path / "one", num_workers=1, num_docs=60)
    assert (tmp_path / "two.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()


def test_a_corpus_that_changes_while_it_is_prepared_is_refused(prepared, tmp_path):
    """Each pass after the first checks the corpus's sha256: a file written in between is a DataError at the end of
    the pass, and the encoding it fed leaves no file."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.txt").write_text("first document")
    corpus, info = read_corpus(str(shards))
    assert list(corpus) == ["first document"]
    (shards / "a.txt").write_text("first document, rewritten")
    changed = rf"data\.source={shards}: changed while it was being prepared"
    with pytest.raises(DataError, match=changed):
        list(corpus)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=changed):
        encode_corpus(corpus, Tokenizer(Path(prepared[0].dir) / "tokenizer.model"), out / "tokens", 1, 1)
    assert list(out.iterdir()) == []
    (shards / "a.txt").unlink()                       # (a file gone since: the same error, naming it)
    with pytest.raises(DataError, match=rf"{changed} \({shards / 'a.txt'}: No such file or directory\)"):
        list(corpus)
    with pytest.raises(TypeError, match="reads the documents twice: give a list or a Corpus, not an iterator"):
        data.tokenizer_sample(iter(["one", "two"]), 100, 1)


def test_an_encoding_process_that_dies_is_an_error_not_a_hang(prepared, tmp_path):
    """A worker that cannot start (its tokenizer.model gone after the run loaded it; a killed one breaks the pool
    alike): one DataError, and no tokens.bin (nor its temporary file)."""
    tok_path = tmp_path / "tokenizer.model"
    shutil.copyfile(Path(prepared[0].dir) / "tokenizer.model", tok_path)
    tok = Tokenizer(tok_path)
    tok_path.unlink()
    with pytest.raises(DataError, match=r"tokens\.bin: an encoding process died \(.*\); out of memory\? try "
                                        r"data\.num_workers=1"):
        encode_corpus(["x = 1\n"] * 10, tok, tmp_path / "tokens", num_workers=2, num_docs=10)
    assert list(tmp_path.iterdir()) == []


def test_a_signal_while_the_tokenizer_trains_keeps_it(small_data, tmp_path, monkeypatch):
    """Sentencepiece answers no signal while it trains: a SIGTERM then (sent from inside the training, so that it
    surely comes then) stops the preparation (launch.Stopped) only once the tokenizer and its record are written,
    and the next preparation finds them cached, not trained again. With another thread alive, as in any process
    with a pool (or a pytest-xdist worker): the kernel may give that thread the signal, and Python then runs the
    handler in the main thread however the main thread blocks it."""
    import signal
    import threading

    from megatron_mini.launch import Stopped, stop_on_signals

    done = threading.Event()
    threading.Thread(target=done.wait, daemon=True).start()

    real = spm.SentencePieceTrainer.train

    def signalled_train(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    cfg = dataclasses.replace(small_data, dir=str(tmp_path / "data"), tokenizer_sample_chars=200_000)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    monkeypatch.setattr(spm.SentencePieceTrainer, "train", signalled_train)
    try:
        stop_on_signals()
        with pytest.raises(Stopped, match="SIGTERM"):
            prepare(cfg)
    finally:
        done.set()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    monkeypatch.undo()
    assert sorted(p.name for p in Path(cfg.dir).iterdir()) == ["tokenizer.json", "tokenizer.model"]
    record = json.loads((Path(cfg.dir) / "tokenizer.json").read_text())
    assert record["sha256"] == Tokenizer(Path(cfg.dir) / "tokenizer.model").sha256
    monkeypatch.setattr(data, "train_tokenizer", lambda *a, **k: pytest.fail("trained again"))
    prepare(cfg)
    assert (Path(cfg.dir) / "tokens.bin").is_file()


def test_an_encoding_process_killed_midway_is_an_error_not_a_hang(prepared, tmp_path):
    """A worker killed while the corpus is encoded (the OOM killer's SIGKILL): the pool ends its other workers with
    SIGTERM, which they must take (they start with it blocked, launch.signals_held), then one DataError, no
    tokens.bin. A watchdog kills the workers after 60 s, so that a hang fails instead of stalling the suite."""
    import multiprocessing
    import signal
    import threading
    import time

    tok = Tokenizer(Path(prepared[0].dir) / "tokenizer.model")
    docs = ["def f(x):\n    return [x * i for i in range(10)]  # a line of code\n" * 50] * 4000    # ~10 MB
    hung, done = [], threading.Event()

    def kill_one_then_watch():
        deadline = time.monotonic() + 60
        while not multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
        if not done.wait(max(0.0, deadline - time.monotonic())):
            hung.append(True)
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGKILL)
    watch = threading.Thread(target=kill_one_then_watch, daemon=True)
    watch.start()
    try:
        with pytest.raises(DataError, match=r"tokens\.bin: an encoding process died"):
            encode_corpus(docs, tok, tmp_path / "tokens", num_workers=2, num_docs=len(docs))
    finally:
        done.set()
        watch.join()
    assert not hung and list(tmp_path.iterdir()) == []


def test_a_corpus_in_shards(tmp_path):
    """A directory's .txt (a document each), .jsonl and .jsonl.gz files (a document a line) below it, in the order of
    their paths; other files are left out; data.text_key names the field; a bad line of a .gz names its line."""
    import gzip

    shards = tmp_path / "shards"
    (shards / "b").mkdir(parents=True)
    (shards / "a.txt").write_text("first")
    (shards / "b" / "c.jsonl").write_text('{"text": "second", "content": "2"}\n{"text": "third", "content": "3"}\n')
    with gzip.open(shards / "b" / "d.jsonl.gz", "wt") as f:
        f.write('{"text": "fourth", "content": "4"}\n')
    (shards / "e.md").write_text("not a document")
    (shards / "f.txt").write_text("fifth")
    docs, info = read_corpus(str(shards))
    assert list(docs) == ["first", "second", "third", "fourth", "fifth"] and info["num_docs"] == 5
    assert list(read_corpus(str(shards / "b" / "d.jsonl.gz"))[0]) == ["fourth"]
    (shards / "a.txt").unlink(), (shards / "f.txt").unlink()
    assert list(read_corpus(str(shards), text_key="content")[0]) == ["2", "3", "4"]
    with gzip.open(shards / "b" / "d.jsonl.gz", "wt") as f:
        f.write('{"text": "fourth"}\n\n{"body": "fifth"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl\.gz:3: expected a JSON object with a \"text\" string "
                                        r"\(data\.text_key names another field\)"):
        read_corpus(str(shards))
    with gzip.open(shards / "b" / "d.jsonl.gz", "wt") as f:
        f.write('{"text": "fourth"}\n')
    whole = (shards / "b" / "d.jsonl.gz").read_bytes()
    for damaged, why in ((whole[:-12], "Compressed file ended before the end-of-stream marker was reached"),
                         (b"not gzip" + whole, "Not a gzipped file")):
        (shards / "b" / "d.jsonl.gz").write_bytes(damaged)
        with pytest.raises(DataError, match=rf"d\.jsonl\.gz: is not a whole gzip file \({why}"):
            read_corpus(str(shards))
    lines = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(2000))
    with gzip.open(shards / "b" / "d.jsonl.gz", "wt") as f:
        f.write(lines)
    whole = (shards / "b" / "d.jsonl.gz").read_bytes()
    for at in (30, len(whole) // 2):        # (the first: a deflate error; the second: parsed, then the checksum)
        flipped = bytearray(whole)
        flipped[at] ^= 0x55
        (shards / "b" / "d.jsonl.gz").write_bytes(bytes(flipped))
        with pytest.raises(DataError, match=r"d\.jsonl\.gz: is not a whole gzip file"):
            read_corpus(str(shards))
    (tmp_path / "no_docs").mkdir()
    (tmp_path / "no_docs" / "x.md").write_text("x")
    with pytest.raises(DataError, match=r"no non-empty documents \(it holds no \.txt, \.jsonl or \.jsonl\.gz file\)"):
        read_corpus(str(tmp_path / "no_docs"))


def test_jsonl_encoding_errors_name_the_line(tmp_path):
    """JSON lines are UTF-8 (a byte-order mark may open the file); a line that is not, or whose text escapes
    a lone surrogate (valid JSON, no Unicode character), is refused with its line number, not a traceback."""
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "caf\xc3\xa9"}\n')
    assert list(read_corpus(str(path))[0]) == ["caf\u00e9"]
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:2: not valid UTF-8 \(byte 14 of the line: b'\\xe9'\)"):
        read_corpus(str(path))
    path.write_text('{"text": "ok"}\n\n{"text": "bad \\ud800 surrogate"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:3: the text holds a lone surrogate \('\\ud800' at character 5\)"):
        read_corpus(str(path))


@pytest.mark.parametrize("line, why", [
    ('{"body": "x", "id": 3}\n', r' \(data\.text_key names another field\): its fields are "body", "id"$'),
    ('{"text": null}\n', r': its "text" is null$'),
    ('{"text": {"a": 1}}\n', r': its "text" is an object$'),
    ('["text"]\n', r": the line is an array$"),
    ('{"text": "a\tb"}\n', r": not valid JSON \(Invalid control character at character 12 of the line\)$"),
    ('{"text": "cut sh', r": not valid JSON \(Unterminated string starting at character 10 of the line\); it is the "
                         r"file's last line, with no newline after it: was the file cut short\?$"),
    ('{"text": "a", "v": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
     r": not valid JSON as Python reads it \(nested too deeply: "),     # (3.14: "Stack overflow", not "maximum ...")
], ids=["no-field", "null", "object", "array", "control-character", "cut-short", "nested-deep"])
def test_a_bad_json_line_says_what_it_is(tmp_path, line, why):
    """A line without a text string names its line and what it holds instead: not JSON (a file cut short mid-line is
    named so), another value, the fields it has, or what its text is; JSON nested too deeply for Python's parser is
    such a line, not a RecursionError's traceback."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n\n' + line)
    with pytest.raises(DataError, match=r'c\.jsonl:3: expected a JSON object with a "text" string' + why):
        read_corpus(str(path))


def test_a_txt_file_that_is_not_utf8_names_its_line(tmp_path):
    """A .txt source is UTF-8 (a byte-order mark may open it, read as it always was); one that is not, a latin-1
    file, is refused with its line and byte, as a .jsonl line is: it was read with each such byte replaced by
    U+FFFD, and trained on so without a word."""
    path = tmp_path / "corpus" / "a.txt"
    path.parent.mkdir()
    path.write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9\n")
    assert list(read_corpus(str(path))[0]) == ["\ufeffcaf\u00e9\n"]   # (the mark kept: the corpus's sha256 as before)
    path.write_bytes(b"ok\ncaf\xe9 au lait\n")
    for source in (path, path.parent):              # (the file, or a directory of .txt files)
        with pytest.raises(DataError, match=r"a\.txt:2: not valid UTF-8 \(byte 4 of the line: b'\\xe9'\); convert "):
            read_corpus(str(source))


def test_prepare_refuses_a_data_dir_it_cannot_write_before_reading(tmp_path, monkeypatch):
    """A data.dir that is a file, under one, or in a read-only directory is one DataError naming data.dir, before
    the corpus is read (it was an OSError traceback); a refusal after data.dir was created leaves no empty
    directory of this run's behind (tools/prepare_data.py's command-line cases: tests/test_cli.py)."""
    import megatron_mini.data as data
    from harness import pretend_read_only

    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "ro").mkdir()
    pretend_read_only(monkeypatch, tmp_path / "ro")
    monkeypatch.setattr(data, "read_corpus", lambda *args: pytest.fail("read the corpus before refusing data.dir"))
    for where, problem in (("afile", f"{tmp_path}/afile is not a directory"),
                           ("afile/sub", f"{tmp_path}/afile is not a directory"),
                           ("ro/sub", f"the directory {tmp_path}/ro is not writable")):
        with pytest.raises(DataError) as refused:
            prepare(DataConfig(source="stdlib", dir=str(tmp_path / where)))
        assert str(refused.value) == f"data.dir={tmp_path / where}: {problem}; choose another data.dir"
    monkeypatch.setattr(data, "read_corpus", lambda *args: read_corpus(str(tmp_path / "nonexistent")))
    with pytest.raises(DataError, match="nonexistent: not found"):
        prepare(DataConfig(source="stdlib", dir=str(tmp_path / "new" / "out")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ro"]
    assert (tmp_path / "afile").read_text() == "keep me" and not list((tmp_path / "ro").iterdir())


def test_tokenizer_vocabulary_out_of_range_says_which_sizes_work(tmp_path):
    """sentencepiece's refusals in data.vocab_size's terms: the smallest size that holds the bytes, the
    special tokens and every character kept, and the largest this corpus can learn; both sizes then train."""
    docs = ["hello world " * 50 + "caf\u00e9 \u2603 \u6f22\u5b57 " * 10] * 20
    with pytest.raises(DataError,
                       match=r"data\.vocab_size=200 is too small for this corpus: .* at least (\d+) tokens") as small:
        train_tokenizer(docs, 200, sample_chars=100_000, seed=1, path=tmp_path / "t.model")
    with pytest.raises(DataError, match=r"data\.vocab_size=20000 is too large .* at most (\d+) tokens") as large:
        train_tokenizer(docs, 20000, sample_chars=100_000, seed=1, path=tmp_path / "t.model")
    with pytest.raises(DataError, match=r"data\.vocab_size=1 is too small: a tokenizer needs 256 byte tokens, <unk> "
                                        r"and EOS, .* set data\.vocab_size >= 258 \(and more for this corpus\)$"):
        train_tokenizer(docs, 1, sample_chars=100_000, seed=1, path=tmp_path / "t.model")   # (sentencepiece's: EOS)
    lo = int(re.search(r"at least (\d+)", str(small.value))[1])
    hi = int(re.search(r"at most (\d+)", str(large.value))[1])
    assert 256 + 2 < lo <= hi < 20000
    for size in (lo, hi):
        train_tokenizer(docs, size, sample_chars=100_000, seed=1, path=tmp_path / "t.model")
        assert Tokenizer(tmp_path / "t.model").vocab_size == size


def _corrupt_bin(out):
    p = out / "tokens.bin"
    p.write_bytes(p.read_bytes()[:-10])
    return "tokens.bin"


def _corrupt_idx(out):
    p = out / "tokens.idx"
    p.write_bytes(p.read_bytes()[:-8])
    return "tokens.idx"


def _bad_magic(out):
    p = out / "tokens.idx"
    p.write_bytes(b"NOTMAGIC" + p.read_bytes()[8:])
    return "tokens.idx"


def _bad_version(out):
    p = out / "tokens.idx"
    p.write_bytes(p.read_bytes()[:8] + (99).to_bytes(4, "little") + p.read_bytes()[12:])
    return "tokens.idx"


def _bad_offsets(out):
    p = out / "tokens.idx"
    raw = bytearray(p.read_bytes())
    raw[-8:] = (10**6).to_bytes(8, "little")
    p.write_bytes(bytes(raw))
    return "tokens.idx"


def _empty_idx(out):
    (out / "tokens.idx").write_bytes(b"")        # (a disk that filled as it was written: shorter than its header)
    return "tokens.idx"


def _meta_counts(out):
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "num_docs": meta["num_docs"] + 1}))   # (another build's)
    return "meta.json"


def _meta_without_source(out):
    meta = json.loads((out / "meta.json").read_text())
    del meta["source"]                           # (it was "holds the corpus None": set data.source=None, no rebuild)
    (out / "meta.json").write_text(json.dumps(meta))
    return "meta.json"


def _other_tokens(out):
    """tokens.bin of another build of as many tokens (here its own rotated by one: valid ids, the same size), copied
    over it: its meta.json's counts still hold."""
    values = np.memmap(out / "tokens.bin", dtype=np.uint16, mode="r+")
    values[:] = np.roll(np.array(values), 1)
    values.flush()
    return ""


def _other_documents(out):
    """tokens.idx that cuts the same tokens into as many other documents (the first one token shorter, the second one
    longer): what a preparation stopped before it wrote meta.json may leave."""
    values = np.memmap(out / "tokens.idx", dtype=np.int64, mode="r+", offset=24)
    n = len(values) // 2
    values[0], values[1], values[n + 1] = values[0] - 1, values[1] + 1, values[n + 1] - 1
    values.flush()
    return ""


def _garbage_meta(out):
    (out / "meta.json").write_text('{"num_docs": ')
    return "meta.json"


def _other_tokenizer(out):
    docs, _ = read_corpus(json.loads((out / "meta.json").read_text())["source"])
    train_tokenizer(docs, VOCAB, sample_chars=100_000, seed=7, path=out / "tokenizer.model")
    return "tokens.bin"


def _garbage_tokenizer(out):
    (out / "tokenizer.model").write_bytes(b"not a model" * 100)
    return "tokenizer.model"


def _missing(name):
    def remove(out):
        (out / name).unlink()
        return name
    remove.__name__ = f"missing_{name}"
    return remove


# the problem the message names, where a case checks it
PROBLEMS = {"_empty_idx": "truncated header", "_meta_counts": "says 41 documents / ",
            "_garbage_meta": "missing or not valid JSON", "_meta_without_source": "names no source corpus: damaged",
            "_other_tokens": "its tokens.bin and tokens.idx are not the files its meta.json was written for",
            "_other_documents": "its tokens.bin and tokens.idx are not the files its meta.json was written for"}


@pytest.mark.parametrize("corrupt", [_corrupt_bin, _corrupt_idx, _bad_magic, _bad_version, _bad_offsets,
                                     _empty_idx, _meta_counts, _meta_without_source, _other_tokens, _other_documents,
                                     _garbage_meta, _other_tokenizer,
                                     _garbage_tokenizer, _missing("tokens.bin"), _missing("tokens.idx"),
                                     _missing("meta.json"), _missing("tokenizer.model")],
                         ids=lambda f: f.__name__.strip("_"))
def test_bad_files_give_one_line_error(copy_of, corrupt, capsys):
    """A damaged build is one line naming the file and its problem, and the rebuild command; that command repairs it,
    saying why it encodes the corpus again (the problem a start names), or reusing the tokens where only the
    tokenizer was damaged (trained again as it was: its tokens are of it)."""
    name = corrupt(Path(copy_of.dir))
    with pytest.raises(DataError) as err:
        load_datasets(copy_of, SEQ, seed=1, vocab_size=VOCAB)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{Path(copy_of.dir) / name}: {PROBLEMS.get(corrupt.__name__, '')}")
    rebuild = f"; rebuild it with: python tools/prepare_data.py data.source={copy_of.source} data.dir={copy_of.dir} " \
              f"data.vocab_size={VOCAB}"
    assert msg.endswith(rebuild)
    capsys.readouterr()
    prepare(copy_of)   # the rebuild command's work repairs it
    said = capsys.readouterr().out
    if corrupt in (_other_tokenizer, _garbage_tokenizer) or name == "tokenizer.model":
        assert "tokens: cached" in said and "encoding" not in said, said
    else:
        assert f"tokens: encoding the corpus again, {msg.removesuffix(rebuild)}\n" in said, said
    load_datasets(copy_of, SEQ, seed=1, vocab_size=VOCAB)


def test_writing_the_index_holds_a_few_bytes_a_document(tmp_path):
    """write_indexed keeps each document's size in an int64 array and writes sizes and offsets without joining them:
    under 24 bytes a document at its peak (traced), where a list of Python ints and the joined file took 48."""
    import tracemalloc

    doc, n = np.full(300, 7, np.uint16), 50_000             # (sizes above 256: Python caches no such int)
    tracemalloc.start()
    try:
        assert data.write_indexed(tmp_path / "t", (doc[:300 - i % 7] for i in range(n)), np.uint16)[0] == n
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 * n, peak / n
    ds = IndexedDataset(tmp_path / "t")
    np.testing.assert_array_equal(ds.sizes, 300 - np.arange(n) % 7)
    assert ds.num_tokens == int(ds.sizes.sum()) and (ds.doc(n - 1) == 7).all()


def test_the_index_is_mapped_not_read_and_checked_in_blocks(tmp_path, monkeypatch):
    """tokens.idx's sizes and offsets are a read-only map of the file (a node's ranks share one copy: 16 bytes a
    document each held before), checked _CHECK_DOCS documents at a time: a size or offset wrong in any block, or at
    a block's edge, is found."""
    monkeypatch.setattr(data, "_CHECK_DOCS", 4, raising=False)
    sizes = np.arange(1, 12, dtype=np.int64)                # 11 documents: blocks 0-3, 4-7, 8-10
    data.write_indexed(tmp_path / "t", [np.full(s, 5, np.uint16) for s in sizes], np.uint16)
    ds = IndexedDataset(tmp_path / "t")
    assert isinstance(ds.sizes, np.memmap) and isinstance(ds.offsets, np.memmap) and not ds.offsets.flags.writeable
    np.testing.assert_array_equal(ds.offsets, np.cumsum(sizes) - sizes)
    whole = (tmp_path / "t.idx").read_bytes()
    for column, doc in ((0, 9), (1, 4), (1, 8), (1, 10), (0, 3)):      # (a size or an offset, at a block's edge too)
        raw = bytearray(whole)
        at = data._HEADER.size + 8 * (column * 11 + doc)
        raw[at:at + 8] = (int.from_bytes(raw[at:at + 8], "little") + 1).to_bytes(8, "little")
        (tmp_path / "t.idx").write_bytes(bytes(raw))
        with pytest.raises(DataError, match="sizes and offsets are inconsistent"):
            IndexedDataset(tmp_path / "t")


def test_wrong_vocab_size(prepared):
    """A valid directory built for another vocabulary is never offered for overwriting: the hint builds
    the asked-for vocabulary in a sibling directory, naming every data key that decides it, and runs with
    that vocabulary (a data.vocab_size left as it was would be refused by the new directory)."""
    cfg, _ = prepared
    with pytest.raises(DataError, match=r"tokenizer\.model: has 512 tokens, but model\.vocab_size=1024") as err:
        load_datasets(cfg, SEQ, seed=1, vocab_size=1024)
    msg = str(err.value)
    sibling = str(Path(cfg.dir).parent / "corpus-v1024")
    assert "\n" not in msg and f"{cfg.dir} is left as it is" in msg
    assert msg.endswith(f"python tools/prepare_data.py data.source={cfg.source} data.dir={sibling} "
                        f"data.vocab_size=1024 and run with data.dir={sibling} data.vocab_size=1024")


@pytest.mark.parametrize("data_vocab, model_vocab, asked, keys", [
    (1024, 1024, "data.vocab_size=1024 and model.vocab_size=1024", "data.vocab_size=512 model.vocab_size=512"),
    (512, 1024, "model.vocab_size=1024", "model.vocab_size=512"),     # (model.vocab_size alone, or a model preset's)
    (1024, 512, "data.vocab_size=1024", "data.vocab_size=512"),
    (1024, 2048, "data.vocab_size=1024 and model.vocab_size=2048", "data.vocab_size=512 model.vocab_size=512")])
def test_a_wrong_vocab_size_names_the_keys_to_set(prepared, data_vocab, model_vocab, asked, keys):
    """A vocabulary size that is not the directory's tokenizer's: the hint sets each key that differs from it, as
    key=N (a model.vocab_size of data.vocab_size's value may be given, not interpolated: the hint names it too)."""
    cfg, _ = prepared
    with pytest.raises(DataError) as err:
        load_datasets(dataclasses.replace(cfg, vocab_size=data_vocab), SEQ, seed=1, vocab_size=model_vocab)
    assert str(err.value).startswith(f"{cfg.dir}/tokenizer.model: has {VOCAB} tokens, but {asked}; set {keys} to "
                                     f"train on it, or: "), str(err.value)


@pytest.mark.parametrize("data_vocab, model_vocab", [(1024, 1024), (512, 1024), (1024, 512), (1024, 2048)])
def test_a_wrong_vocab_size_hint_followed_literally_starts_the_run(prepared, data_vocab, model_vocab):
    """The keys a wrong vocabulary size says to set (`set K=V ... to train on it`), set as given on the command line,
    open the directory: model.vocab_size keeps its value unless the hint names it (a model.vocab_size given, or
    bloom-176b's preset: it follows data.vocab_size only where a preset interpolates it, which the check cannot
    see), so data.vocab_size=1024 model.vocab_size=1024 must name both. Likewise the keys it says to run a new
    build of the asked-for vocabulary with (model.vocab_size where it is not that size too)."""
    cfg, _ = prepared
    with pytest.raises(DataError) as err:
        load_datasets(dataclasses.replace(cfg, vocab_size=data_vocab), SEQ, seed=1, vocab_size=model_vocab)
    keys = dict(re.findall(r"(\S+)=(\d+)", re.search(r"; set (.*?) to train on it", str(err.value))[1]))
    assert keys and set(keys) <= {"data.vocab_size", "model.vocab_size"}, str(err.value)
    load_datasets(dataclasses.replace(cfg, vocab_size=int(keys.get("data.vocab_size", data_vocab))), SEQ, seed=1,
                  vocab_size=int(keys.get("model.vocab_size", model_vocab)))
    built, run = re.search(r"build it in its own directory with: (.*?) and run with (.*)", str(err.value)).groups()
    built = int(re.search(r"data\.vocab_size=(\d+)", built)[1])      # (the other way on: a new build, its keys)
    keys = dict(re.findall(r"(\S+)=(\d+)", run))
    assert int(keys.get("data.vocab_size", data_vocab)) == int(keys.get("model.vocab_size", model_vocab)) == built, \
        str(err.value)


def test_other_source_is_not_overwritten(prepared, tmp_path):
    cfg, _ = prepared
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="holds the corpus") as err:
        load_datasets(dataclasses.replace(cfg, source=str(other)), SEQ, seed=1, vocab_size=VOCAB)
    sibling = str(Path(cfg.dir).parent / f"other-v{VOCAB}")
    assert f"data.source={other} data.dir={sibling} data.vocab_size={VOCAB}" in str(err.value)
    named = tmp_path / f"other-v{VOCAB}"          # data.dir bears the name the hint gives a new build: not offered
    shutil.copytree(cfg.dir, named)
    with pytest.raises(DataError, match="holds the corpus") as err:
        load_datasets(dataclasses.replace(cfg, source=str(other), dir=str(named)), SEQ, seed=1, vocab_size=VOCAB)
    assert f"{named} is left as it is" in str(err.value)
    assert f"data.dir={named}-new data.vocab_size={VOCAB} and run with data.dir={named}-new" in str(err.value)


def test_prepare_never_builds_over_other_data(copy_of, tmp_path):
    """A valid directory of another corpus or vocabulary (data.dir's default names only the vocabulary, so
    `data.source=...` alone points at the default data) is left byte for byte as it is, with the command that
    builds the asked-for data beside it; a directory removed first is built."""
    out = Path(copy_of.dir)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    other = tmp_path / "other.jsonl"
    texts = [f.read_text()[::-1] for f in sorted(Path(copy_of.source).glob("*.txt"))]    # another corpus, as rich
    other.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    sibling = out.parent / f"other-v{VOCAB}"
    with pytest.raises(DataError, match=r"meta\.json: holds the corpus .*, but data\.source=") as err:
        prepare(dataclasses.replace(copy_of, source=str(other)))
    assert (f"data.source={other} data.dir={sibling} data.vocab_size={VOCAB} and run with data.dir={sibling} "
            f"(to rebuild {out} itself, remove it first)") in str(err.value)
    with pytest.raises(DataError, match=f"tokenizer\\.model: has {VOCAB} tokens, but data\\.vocab_size=600"):
        prepare(dataclasses.replace(copy_of, vocab_size=600))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    shutil.rmtree(out)
    assert prepare(dataclasses.replace(copy_of, source=str(other)))["num_docs"] == len(texts)


def test_a_build_of_a_corpus_that_reads_otherwise_now_is_kept_beside_its_new_build(tmp_path, monkeypatch, capsys):
    """The same source read otherwise (a file changed; another Python's stdlib; another version's reading) is built
    again in place, and the valid build it replaces, which runs and checkpoints may read, is kept byte for byte as
    hard links in <dir>.superseded-<its corpus sha256[:12]>, which is itself never built again (a run given it as
    data.dir prepares it first under make train); where no link can be made, nothing is rebuilt nor made."""
    corpus = make_text_corpus(tmp_path / "corpus", 10)
    cfg = DataConfig(source=str(corpus), dir=str(tmp_path / "out"), vocab_size=VOCAB, val_fraction=0.1,
                     num_workers=1)
    old = prepare(cfg)
    assert "tokens: encoding" not in capsys.readouterr().out                 # (a first build: nothing to say why)
    before = {p.name: p.read_bytes() for p in Path(cfg.dir).iterdir() if not p.name.startswith(".")}
    first = sorted(corpus.iterdir())[0]
    first.write_text(first.read_text() + "\nchanged = True\n")
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(1, "Operation not permitted")))
    with pytest.raises(DataError, match="could not be kept beside the new one as hard links .*Operation not permitted"):
        prepare(cfg)
    assert {p.name: p.read_bytes() for p in Path(cfg.dir).iterdir() if not p.name.startswith(".")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]
    inode = (Path(cfg.dir) / "tokens.bin").stat().st_ino
    monkeypatch.undo()
    capsys.readouterr()
    new = prepare(cfg)
    keep = tmp_path / f"out.superseded-{old['corpus_sha256'][:12]}"
    assert new["corpus_sha256"] != old["corpus_sha256"]
    said = capsys.readouterr().out
    assert f"kept the build of the corpus as it read before (sha256 {old['corpus_sha256'][:12]}) in {keep}" in said
    assert f"tokens: encoding the corpus again, {cfg.dir}/meta.json: its tokens are of the corpus {corpus} as it " \
           f"read before (sha256 {old['corpus_sha256'][:12]}), which now reads {new['corpus_sha256'][:12]}\n" in said
    assert {p.name: p.read_bytes() for p in keep.iterdir()} == before
    assert (keep / "tokens.bin").stat().st_ino == inode                              # linked, not copied
    assert json.loads((Path(cfg.dir) / "meta.json").read_text()) == new
    prepare(cfg)                                                     # cached: nothing more is kept
    assert prepare(dataclasses.replace(cfg, dir=str(keep))) == old                   # the kept build, as it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out", keep.name]
    assert {p.name: p.read_bytes() for p in keep.iterdir() if not p.name.startswith(".")} == before


def test_a_corpus_encoded_with_a_given_tokenizer(prepared, tmp_path, capsys):
    """data.tokenizer: the corpus is encoded with that tokenizer (copied into data.dir: the same sha256), so that a
    run on it may init_from the checkpoints of runs on the other data; its size must be data.vocab_size; a second
    prepare is cached; the rebuild command names it."""
    cfg, _ = prepared
    given = Tokenizer(Path(cfg.dir) / "tokenizer.model")
    path = tmp_path / "c.jsonl"
    texts = ("def f(x):\n    return x\n", "class A:\n    pass\n")
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    other = DataConfig(source=str(path), dir=str(tmp_path / "out"), vocab_size=VOCAB, tokenizer=str(given.path),
                       num_workers=1)
    meta = prepare(other)
    tok = Tokenizer(tmp_path / "out" / "tokenizer.model")
    assert tok.sha256 == given.sha256 == meta["tokenizer_sha256"]
    ds = IndexedDataset(tmp_path / "out" / "tokens")
    assert [given.decode(ds.doc(i)[:-1].tolist()) for i in range(len(ds))] == list(read_corpus(str(path))[0])
    capsys.readouterr()
    prepare(other)
    assert "tokens: cached" in capsys.readouterr().out
    assert f"data.tokenizer={given.path}" in rebuild_command(other)
    shards = tmp_path / "shards"                       # (what a directory's preparation leaves out, it says)
    shards.mkdir()
    (shards / "c.jsonl").write_text(path.read_text() + '{"text": ""}\n')
    (shards / "empty.txt").write_text("")
    (shards / "notes.md").write_text("not a document")
    (shards / "LICENSE").write_text("not a document")
    prepare(dataclasses.replace(other, source=str(shards), dir=str(tmp_path / "sharded")))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("corpus: "))
    assert line.startswith(f"corpus: 2 documents, {sum(map(len, texts))} characters from {shards} (sha256 ") and \
        line.endswith("; left out: 2 empty documents, 2 files neither .txt nor .jsonl(.gz) (.md, LICENSE)"), line
    with pytest.raises(DataError, match=rf"data\.tokenizer={given.path}: has {VOCAB} tokens, but data\.vocab_size=256; "
                                        rf"set data\.vocab_size={VOCAB}"):
        prepare(dataclasses.replace(other, vocab_size=256, dir=str(tmp_path / "out256")))
    (tmp_path / "bad.model").write_bytes(b"not a model")
    (tmp_path / "adir").mkdir()                                          # (a prepared directory, say)
    shutil.copyfile(given.path, tmp_path / "adir" / "tokenizer.model")
    for bad, problem in (("nowhere.model", "missing"), ("bad.model", "not a valid sentencepiece model"),
                         ("adir", r"is a directory, not a sentencepiece model file \(give its tokenizer\.model\)")):
        with pytest.raises(DataError, match=rf"^data\.tokenizer={tmp_path / bad}: {problem}$"):   # (no rebuild hint)
            prepare(dataclasses.replace(other, tokenizer=str(tmp_path / bad), source=str(tmp_path / "no-corpus")))


def test_a_given_tokenizer_without_eos_is_refused_before_encoding(prepared, tmp_path):
    """Each document ends with EOS in tokens.bin: a data.tokenizer without one (eos_id -1, here the given model with
    its </s> made an ordinary piece) is refused in one line; its -1 overflowed the uint16 array in an encoding
    process (a traceback), and in an int32 one became an id the run then refused as outside the vocabulary."""
    from sentencepiece import sentencepiece_model_pb2
    cfg, _ = prepared
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((Path(cfg.dir) / "tokenizer.model").read_bytes())
    proto.trainer_spec.eos_id, proto.pieces[1].type = -1, proto.SentencePiece.USER_DEFINED
    (tmp_path / "no-eos.model").write_bytes(proto.SerializeToString())
    assert Tokenizer(tmp_path / "no-eos.model").eos_id == -1
    with pytest.raises(DataError, match=rf"^data\.tokenizer={tmp_path / 'no-eos.model'}: has no EOS piece \(eos_id "
                                        r"-1\), which ends each document in tokens\.bin; give a sentencepiece model "
                                        r"trained with an eos_id, or leave data\.tokenizer out to train one$"):
        prepare(DataConfig(source=cfg.source, dir=str(tmp_path / "out"), vocab_size=VOCAB,
                           tokenizer=str(tmp_path / "no-eos.model"), num_workers=1))
    assert not (tmp_path / "out").exists()


def test_a_given_tokenizer_is_never_swapped_in_a_valid_build(prepared, small_data, tmp_path):
    """Over a valid build, prepare neither trains a tokenizer where data.tokenizer gave one (the rebuild command
    gives it again), nor copies another given one over its tokenizer: runs, and checkpoints that other data's runs
    init_from, read those token ids. A directory that is no valid build takes the given tokenizer."""
    cfg, _ = prepared
    given, other = Tokenizer(Path(cfg.dir) / "tokenizer.model"), Tokenizer(Path(small_data.dir) / "tokenizer.model")
    out = DataConfig(source=cfg.source, dir=str(tmp_path / "out"), vocab_size=VOCAB, tokenizer=str(given.path),
                     num_workers=1)
    prepare(out)
    trained = dataclasses.replace(out, tokenizer=None)
    assert f"data.tokenizer={given.path.resolve()}" in rebuild_command(trained)
    with pytest.raises(DataError, match=rf"tokenizer\.model: is a copy of {given.path.resolve()} \(data\.tokenizer\), "
                                        rf"in a valid build .* give data\.tokenizer={given.path.resolve()} to prepare "
                                        r"it again"):
        prepare(trained)
    with pytest.raises(DataError, match=rf"tokenizer\.model: is another tokenizer \(sha256 {given.sha256[:12]}\) than "
                                        rf"data\.tokenizer={other.path} \({other.sha256[:12]}\)"):
        prepare(dataclasses.replace(out, tokenizer=str(other.path)))
    assert Tokenizer(tmp_path / "out" / "tokenizer.model").sha256 == given.sha256
    for name, damaged in (("partial", other.path.read_bytes()), ("broken", b"not a model")):
        (tmp_path / name).mkdir()                        # another tokenizer, or none, but no build: it is replaced
        (tmp_path / name / "tokenizer.model").write_bytes(damaged)
        prepare(dataclasses.replace(out, dir=str(tmp_path / name)))
        assert Tokenizer(tmp_path / name / "tokenizer.model").sha256 == given.sha256


def test_a_valid_build_is_never_retrained_with_other_tokenizer_settings(copy_of):
    """prepare with another data.tokenizer_seed or tokenizer_sample_chars over a valid build is refused, as another
    vocabulary is: it retrained the tokenizer and re-encoded the tokens without a word, so the runs of the build
    could no longer find the tokenizer their checkpoints were trained with. The same settings prepare it again."""
    before = Tokenizer(Path(copy_of.dir) / "tokenizer.model").sha256
    for change in ({"tokenizer_seed": 7}, {"tokenizer_sample_chars": 200_000}):
        key, value = next(iter(change.items()))
        with pytest.raises(DataError, match=rf"tokenizer\.model: was trained with data\.tokenizer_sample_chars="
                                            rf"{copy_of.tokenizer_sample_chars}, data\.tokenizer_seed="
                                            rf"{copy_of.tokenizer_seed}, in a valid build that runs may read; "
                                            rf".* build it in its own directory with: .*data\.{key}={value}.* "
                                            rf"\(to rebuild {copy_of.dir} itself, remove it first\)$"):
            prepare(dataclasses.replace(copy_of, **change))
        assert Tokenizer(Path(copy_of.dir) / "tokenizer.model").sha256 == before
    prepare(copy_of)
    assert Tokenizer(Path(copy_of.dir) / "tokenizer.model").sha256 == before


def test_prepare_notes_documents_that_hold_the_whitespace_symbol(prepared, tmp_path, capsys):
    """A literal U+2581 encodes as a space (sentencepiece's whitespace symbol: the text does not round-trip there):
    prepare says how many documents hold one and where the first is."""
    tok = Tokenizer(Path(prepared[0].dir) / "tokenizer.model")
    assert tok.encode("a\u2581b") == tok.encode("a b") and tok.decode(tok.encode("\u2581\u2582")) == " \u2582"
    corpus = tmp_path / "c.jsonl"
    texts = ["def f():\n    pass\n", "bars: \u2581\u2582\u2583\n", "x = 1\n", "\u2581\u2581x\n"]
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    prepare(DataConfig(source=str(corpus), dir=str(tmp_path / "out"), vocab_size=VOCAB, num_workers=1,
                       tokenizer=str(tok.path)))
    out = capsys.readouterr().out
    assert f"note: 2 documents hold U+2581 ('\u2581', the first in {corpus}): sentencepiece's whitespace symbol, " \
           "which it encodes as a space (the model sees a space)\n" in out, out
    corpus.write_text(json.dumps({"text": texts[0]}) + "\n")
    prepare(DataConfig(source=str(corpus), dir=str(tmp_path / "out2"), vocab_size=VOCAB, num_workers=1,
                       tokenizer=str(tok.path)))
    assert "U+2581" not in capsys.readouterr().out


def test_a_jsonl_builds_text_key_and_a_given_tokenizer_are_checked_by_training_too(prepared, small_data, tmp_path):
    """A build of JSON lines records its text_key: prepare with another refuses to re-encode the build, and a run
    that asks for another field is refused (as another data.source is); a run given data.tokenizer checks that it
    is the directory's (it read the directory's own without a word, whatever data.tokenizer named), or the file
    the directory's copy was made from, removed since."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": text, "title": text[:40]}) + "\n" for text in read_corpus(
        prepared[0].source)[0]))
    cfg = DataConfig(source=str(corpus), dir=str(tmp_path / "out"), vocab_size=VOCAB, num_workers=1)
    assert prepare(cfg)["text_key"] == "text"
    titles = dataclasses.replace(cfg, text_key="title")
    with pytest.raises(DataError, match=r"meta\.json: holds the \"text\" field of its JSON lines, but data\.text_key="
                                        r"title; .* data\.text_key=title .*remove it first\)$"):
        prepare(titles)
    with pytest.raises(DataError, match=r"meta\.json: holds the \"text\" field .* but data\.text_key=title; set "
                                        r"data\.text_key=text to train on it, or: "):
        load_datasets(titles, SEQ, seed=3, vocab_size=VOCAB)
    other = Tokenizer(Path(small_data.dir) / "tokenizer.model")
    with pytest.raises(DataError, match=r"tokenizer\.model: is another tokenizer \(sha256 .*\) than data\.tokenizer="
                                        rf"{other.path} \({other.sha256[:12]}\); set data\.tokenizer to it \(or leave "
                                        r"it out\) to train on it, or: prepare this corpus with data\.tokenizer="):
        load_datasets(dataclasses.replace(cfg, tokenizer=str(other.path)), SEQ, seed=3, vocab_size=VOCAB)
    with pytest.raises(DataError, match=rf"^data\.tokenizer={tmp_path / 'no.model'}: missing$"):
        load_datasets(dataclasses.replace(cfg, tokenizer=str(tmp_path / "no.model")), SEQ, seed=3, vocab_size=VOCAB)
    own = str(tmp_path / "out" / "tokenizer.model")
    assert len(load_datasets(dataclasses.replace(cfg, tokenizer=own), SEQ, seed=3, vocab_size=VOCAB)[0]) > 0
    gone = tmp_path / "gone" / "tokenizer.model"   # (a given tokenizer removed since: the build's copy stands for it)
    gone.parent.mkdir()
    shutil.copyfile(own, gone)
    copied = dataclasses.replace(cfg, dir=str(tmp_path / "copied"), tokenizer=str(gone))
    prepare(copied)
    shutil.rmtree(gone.parent)
    assert len(load_datasets(copied, SEQ, seed=3, vocab_size=VOCAB)[0]) > 0
    with pytest.raises(DataError, match=rf"^data\.tokenizer={tmp_path / 'no.model'}: missing$"):
        load_datasets(dataclasses.replace(copied, tokenizer=str(tmp_path / "no.model")), SEQ, seed=3, vocab_size=VOCAB)
    prepare(dataclasses.replace(titles, dir=str(tmp_path / "titles"), tokenizer=own))   # (a set read by its own key)
    sets = load_eval_sets(dataclasses.replace(cfg, eval=[str(tmp_path / "titles")]), SEQ, VOCAB, Tokenizer(own))
    assert len(sets[str(tmp_path / "titles")]) > 0


def test_a_corpus_of_one_document_is_split_by_tokens(prepared, tmp_path):
    """A single .txt file is one document, which validation cannot hold out whole: its first 1 - val_fraction of
    tokens train and the rest validate (nanoGPT's split of shakespeare.txt); it could be prepared but never trained
    on, at any val_fraction. A set too short for one sample names which, and the val_fraction that helps it."""
    text = "".join(Path(p).read_text() for p in sorted(Path(prepared[0].source).glob("*.txt"))[:10])
    (tmp_path / "one.txt").write_text(text)
    cfg = DataConfig(source=str(tmp_path / "one.txt"), dir=str(tmp_path / "out"), vocab_size=VOCAB,
                     val_fraction=0.1, tokenizer=str(Path(prepared[0].dir) / "tokenizer.model"), num_workers=1)
    assert prepare(cfg)["num_docs"] == 1
    train, val, _ = load_datasets(cfg, SEQ, seed=3, vocab_size=VOCAB)
    tokens = IndexedDataset(tmp_path / "out" / "tokens").doc(0)
    cut = round(0.9 * len(tokens))
    assert (train.num_tokens, val.num_tokens) == (cut, len(tokens) - cut)
    assert len(train) == (cut - 1) // SEQ and len(val) == (len(tokens) - cut - 1) // SEQ
    def windows(start, stop):                      # (each sample once an epoch, in some order)
        return {tuple(tokens[k:k + SEQ + 1]) for k in range(start, stop - SEQ, SEQ)}
    assert {tuple(train[i]) for i in range(len(train))} == windows(0, cut)
    assert {tuple(val[i]) for i in range(len(val))} == windows(cut, len(tokens))
    long = len(tokens) // 5                        # (more than the last tenth, less than the first nine)
    with pytest.raises(DataError, match=rf"the validation set: one document of {len(tokens):,} tokens, split by "
                                        rf"tokens, gives it {len(tokens) - cut:,}, fewer than one sample of seq_len "
                                        rf"\+ 1 = {long + 1}; use a larger corpus, a larger data\.val_fraction"):
        load_datasets(cfg, long, seed=3, vocab_size=VOCAB)
    whole = IndexedDataset(Path(prepared[0].dir) / "tokens").num_tokens
    with pytest.raises(DataError, match=rf"the training set: 36 documents hold .* fewer than one sample of seq_len "
                                        rf"\+ 1 = {whole}; use a larger corpus, a smaller data\.val_fraction or a "
                                        rf"shorter sequence \(model\.seq_len\)$"):
        load_datasets(prepared[0], whole - 1, seed=3, vocab_size=VOCAB)     # (the whole corpus is one sample)
    with pytest.raises(DataError, match=rf"the training set: 36 documents hold .* fewer than one sample of seq_len "
                                        rf"\+ 1 = {whole + 1}, as the whole corpus does \({whole:,} tokens\); use "
                                        rf"a larger corpus or a shorter sequence \(model\.seq_len\)$"):
        load_datasets(prepared[0], whole, seed=3, vocab_size=VOCAB)


def test_rebuild_command_names_the_directory_the_run_reads():
    """The built-in data.dir is named too: prepare_data.py's own default depends on data.vocab_size."""
    assert rebuild_command(DataConfig()) == "make data"
    assert rebuild_command(DataConfig(vocab_size=4096)) == ("python tools/prepare_data.py data.source=stdlib "
                                                            "data.dir=data/stdlib-v8192 data.vocab_size=4096")
    assert rebuild_command(DataConfig(source="c.jsonl", dir="d", text_key="content")) == (
        "python tools/prepare_data.py data.source=c.jsonl data.dir=d data.vocab_size=8192 data.text_key=content")


def test_split_and_samples(prepared):
    cfg, _ = prepared
    train, val, _ = load_datasets(cfg, SEQ, seed=3, vocab_size=VOCAB)
    ds = train.indexed
    train_ids, val_ids = split_documents(len(ds), cfg.val_fraction, seed=3)
    assert len(val_ids) == round(cfg.val_fraction * len(ds)) and not set(train_ids) & set(val_ids)
    assert sorted([*train_ids, *val_ids]) == list(range(len(ds)))
    assert (train.num_docs, val.num_docs) == (len(train_ids), len(val_ids))
    # sample k is tokens [k*SEQ, k*SEQ + SEQ + 1) of the train documents, concatenated
    flat = np.concatenate([ds.doc(i) for i in train_ids])
    expected = Counter(tuple(flat[k * SEQ:k * SEQ + SEQ + 1]) for k in range(len(train)))
    epochs = [[train[e * len(train) + i] for i in range(len(train))] for e in (0, 1)]
    assert all(s.dtype == np.int64 and s.shape == (SEQ + 1,) for s in epochs[0])
    assert Counter(map(tuple, epochs[0])) == Counter(map(tuple, epochs[1])) == expected   # each sample once per epoch
    assert [tuple(s) for s in epochs[0]] != [tuple(s) for s in epochs[1]]                 # in a new order
    assert len(train) == (len(flat) - 1) // SEQ


def test_an_epochs_order_is_its_seeded_permutation_held_in_int32():
    """Epoch e's order is rng([seed, e]).permutation(n), the order every run has read, held in int32 (half an
    int64 permutation's memory: 0.55 GiB a rank, not 1.1, for a 146M-sample epoch)."""
    for n in (1, 7, 100_003):
        order = epoch_order(n, 1234, 5)
        assert order.dtype == np.int32
        assert np.array_equal(order, np.random.default_rng([1234, 5]).permutation(n))


def test_samples_of_documents_of_any_length_are_windows_of_their_concatenation(tmp_path):
    """Token t of the file is t (so a sample shows where it was cut). Documents of 1, 2, seq_len, seq_len + 1 and many
    samples' tokens, a random subset of them (runs broken by held-out ones): dataset[i] for two epochs is, by a plain
    re-derivation, window p_e[k] = tokens [p_e[k] seq, p_e[k] seq + seq + 1) of the subset's concatenation, p_e =
    rng([seed, e]).permutation(n), n = (tokens - 1) // seq, i = e n + k; each epoch reads its n windows once and the
    last (tokens - 1) mod seq tokens never; the train/validation split (by documents, and of one document by tokens)
    shares no token; a set of seq tokens is no sample."""
    from megatron_mini.dataset import GPTDataset, split
    seq, rng = 8, np.random.default_rng(0)
    sizes = rng.choice([1, 2, seq, seq + 1, 5 * seq + 3], size=300)
    data.write_indexed(tmp_path / "t", np.split(np.arange(sizes.sum()), np.cumsum(sizes)[:-1]), np.uint16)
    ds = IndexedDataset(tmp_path / "t")
    alone = [np.flatnonzero(sizes == size)[:1] for size in (seq, seq + 1)]      # (no sample; exactly one)
    for ids in (np.arange(len(sizes)), np.sort(rng.choice(len(sizes), 120, replace=False)), *alone):
        flat = np.concatenate([np.arange(ds.offsets[i], ds.offsets[i] + ds.sizes[i]) for i in ids])
        if len(flat) <= seq:
            with pytest.raises(ValueError, match="fewer than one sample"):
                GPTDataset(ds, ids, seq, 5)
            continue
        gpt, n = GPTDataset(ds, ids, seq, 5), (len(flat) - 1) // seq
        assert len(gpt) == n and gpt.num_tokens == len(flat)
        for e in (0, 1):
            order = np.random.default_rng([5, e]).permutation(n)
            got = np.stack([gpt[e * n + k] for k in range(n)])
            np.testing.assert_array_equal(got, [flat[w * seq:w * seq + seq + 1] for w in order])
            assert np.array_equal(np.unique(got), flat[:n * seq + 1])          # all but the last (tokens-1) mod seq
    data.write_indexed(tmp_path / "one", [np.arange(1000)], np.uint16)
    for d in (ds, IndexedDataset(tmp_path / "one")):
        train, val = split(d, 0.2, seq, 3)
        read = [np.unique(np.stack([part[i] for i in range(len(part))])) for part in (train, val)]
        assert not np.intersect1d(*read).size and len(read[0]) > 3 * len(read[1]) > 0


def test_a_validation_set_of_most_of_the_tokens_is_noted(tmp_path):
    """The split draws documents: where the one held out is a corpus's largest (92% of its tokens), start-up says
    so, naming the directory (a blend's too); a split near val_fraction, or a corpus of one document (split by
    tokens), gives no note."""
    from megatron_mini.dataset import BlendedDataset, split, split_notes

    data.write_indexed(tmp_path / "skew", [np.ones(s, np.uint16) for s in (5000, 100, 100, 100, 100)], np.uint16)
    data.write_indexed(tmp_path / "one", [np.ones(3000, np.uint16)], np.uint16)
    skew, one = IndexedDataset(tmp_path / "skew"), IndexedDataset(tmp_path / "one")
    held = {}
    for seed in range(10, 18):                             # (13 and 16 hold out the large one)
        train, val = split(skew, 0.02, 16, seed)
        notes = split_notes(train, val, 0.02)
        held[seed] = 0 in split_documents(5, 0.02, seed)[1]
        assert len(notes) == held[seed], (seed, notes)
        if held[seed]:
            assert notes[0].startswith(f"note: the validation set of {tmp_path} holds 92.6% of its tokens, in 1 of "
                                       f"its 5 documents (data.val_fraction=0.02 draws documents, not tokens), so "
                                       f"training reads 7.4% of them")
            parts = [split(one, 0.02, 16, seed), (train, val)]
            blended = [BlendedDataset([p[k] for p in parts], [Fraction(1, 2)] * 2) for k in (0, 1)]
            assert split_notes(*blended, 0.02) == notes
        assert split_notes(*split(one, 0.02, 16, seed), 0.02) == []
    assert set(held.values()) == {True, False}


def test_the_validation_documents_are_those_every_run_has_held_out():
    """split_documents, marking the first n_val of an int32 shuffle, holds out the documents of the sorted int64
    permutation it drew before (a run's split, and so its resume, is unchanged)."""
    for n, fraction, seed in ((2, 0.5, 0), (3, 0.9, 1), (1000, 0.02, 1234), (100_003, 0.1, 7)):
        perm = np.random.default_rng(seed).permutation(n)
        n_val = min(max(1, round(fraction * n)), n - 1)
        for got, want in zip(split_documents(n, fraction, seed), (np.sort(perm[n_val:]), np.sort(perm[:n_val]))):
            assert got.dtype == np.int64 and np.array_equal(got, want)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batches_do_not_depend_on_dp(prepared, dp):
    cfg, _ = prepared
    train, _, _ = load_datasets(cfg, SEQ, seed=3, vocab_size=VOCAB)
    gbs, mbs = 8, 2
    seen = []
    for consumed in range(0, (len(train) // gbs) * gbs, gbs):
        ranks = [get_batch(train, consumed, gbs, mbs, d, dp) for d in range(dp)]
        assert all(r.shape == (gbs // (dp * mbs), mbs, SEQ + 1) for r in ranks)
        union = np.concatenate([r.reshape(-1, SEQ + 1).numpy() for r in ranks])
        np.testing.assert_array_equal(union, get_batch(train, consumed, gbs, gbs, 0, 1)[0].numpy())
        seen += map(tuple, union)
    # every sample of the epoch (all but the last partial batch) exactly once, over all ranks
    assert Counter(seen) == Counter(tuple(train[i]) for i in range((len(train) // gbs) * gbs))


def test_resume_continues_at_the_next_sample(prepared):
    cfg, _ = prepared
    train, _, _ = load_datasets(cfg, SEQ, seed=3, vocab_size=VOCAB)
    gbs, first = 4, len(train) // 4 - 5          # the run crosses the end of the first epoch
    run = [get_batch(train, step * gbs, gbs, 2, 0, 1) for step in range(first + 10)]
    resumed, _, _ = load_datasets(cfg, SEQ, seed=3, vocab_size=VOCAB)   # a new process after a checkpoint
    consumed = first * gbs
    for step in range(first, len(run)):
        assert get_batch(resumed, consumed, gbs, 2, 0, 1).equal(run[step])
        consumed += gbs


def test_second_prepare_is_cached(prepared, monkeypatch, capsys):
    """A prepare of a valid build changes nothing, and opens it once (checks its index, reads its tokens_fingerprint's
    blocks): what it refuses (another corpus, vocabulary or tokenizer) and what it reuses are that one build's (it
    was opened three times)."""
    cfg, meta = prepared
    files = {p: p.stat().st_mtime_ns for p in Path(cfg.dir).iterdir()}
    read = []
    monkeypatch.setattr(data, "fingerprint", lambda path, f=data.fingerprint: read.append(Path(path).name) or f(path))
    assert prepare(cfg) == meta
    out = capsys.readouterr().out
    assert "tokenizer: cached" in out and "tokens: cached" in out
    assert files == {p: p.stat().st_mtime_ns for p in Path(cfg.dir).iterdir()}
    assert sorted(read) == ["tokens.bin", "tokens.idx"]


def test_a_build_whose_tokenizer_is_trained_anew_says_why_it_encodes_again(copy_of, monkeypatch, capsys):
    """A valid build whose tokenizer is trained again (its record is of older training settings:
    _TOKENIZER_SETTINGS) into another one (here from a sample of 100,000 characters, not the whole corpus) is encoded
    again, and prepare says why: its tokens.bin is of the tokenizer it replaced (it was encoded again without a
    word)."""
    out = Path(copy_of.dir)
    old = json.loads((out / "meta.json").read_text())["tokenizer_sha256"]
    monkeypatch.setattr(data, "_TOKENIZER_SETTINGS", data._TOKENIZER_SETTINGS + 1)
    monkeypatch.setattr(data, "train_tokenizer", lambda docs, vocab, chars, seed, path, record, f=data.train_tokenizer:
                        f(docs, vocab, 100_000, seed, path, record))
    capsys.readouterr()
    new = prepare(copy_of)["tokenizer_sha256"]
    assert new != old
    assert f"tokens: encoding the corpus again, {out}/tokens.bin: encoded with another tokenizer (sha256 {old[:12]} " \
           f"in meta.json, {out}/tokenizer.model has {new[:12]})\n" in capsys.readouterr().out


def test_a_build_records_its_tokens_fingerprint_which_a_start_reads_once(copy_of, monkeypatch, capsys):
    """meta.json records the tokens_fingerprint of the files it was written for, the value that data_identity puts in
    checkpoints; a start (load_datasets, then data_identity) reads each token file's blocks once. A directory prepared
    before meta.json recorded it opens as before, other token files too (a resume still compares them), and a
    prepare over it records it without encoding again (tokens.bin and .idx untouched)."""
    from megatron_mini.dataset import data_identity
    out = Path(copy_of.dir)
    meta = json.loads((out / "meta.json").read_text())
    read = []
    monkeypatch.setattr(data, "fingerprint", lambda path, f=data.fingerprint: read.append(Path(path).name) or f(path))
    datasets = load_datasets(copy_of, SEQ, seed=1, vocab_size=VOCAB)
    assert data_identity(copy_of, datasets)["tokens_fingerprint"] == meta["tokens_fingerprint"]
    assert sorted(read) == ["tokens.bin", "tokens.idx"]
    del meta["tokens_fingerprint"]
    (out / "meta.json").write_text(json.dumps(meta))
    tokens = (out / "tokens.bin").read_bytes()
    _other_tokens(out)
    load_datasets(copy_of, SEQ, seed=1, vocab_size=VOCAB)
    (out / "tokens.bin").write_bytes(tokens)
    files = {name: (out / name).stat().st_mtime_ns for name in ("tokens.bin", "tokens.idx")}
    capsys.readouterr()
    recorded = prepare(copy_of)["tokens_fingerprint"]
    assert "tokens: cached" in capsys.readouterr().out
    assert json.loads((out / "meta.json").read_text()) == {**meta, "tokens_fingerprint": recorded}
    assert recorded == data_identity(copy_of, load_datasets(copy_of, SEQ, seed=1, vocab_size=VOCAB))[
        "tokens_fingerprint"]
    assert files == {name: (out / name).stat().st_mtime_ns for name in ("tokens.bin", "tokens.idx")}


def test_one_preparation_at_a_time_and_what_a_killed_one_left(copy_of, prepared, capsys):
    """While a preparation holds data.dir's lock (here this process, by another open file), a second waits for it,
    saying whom it waits for and changing nothing meanwhile; then it first removes the temporary files of a
    preparation killed outright (tokens.bin.tmp<pid> as large as the corpus, an atomic write's), finds the rest
    ready, and leaves no .lock behind."""
    import threading
    import time

    from megatron_mini.files import DirectoryLock

    out = Path(copy_of.dir)
    left = {"tokens.bin.tmp4242": b"\0" * 1000, "meta.json.tmp77": b"{", "notes.tmp": b"mine", "a.tmp1x": b"mine",
            "draft.tmp2024": b"mine", "tokens.bin.tmp1.csv": b"mine"}
    for name, content in left.items():
        (out / name).write_bytes(content)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result, printed = [], ""
    with DirectoryLock(out, "a test"):
        second = threading.Thread(target=lambda: result.append(prepare(copy_of)), daemon=True)
        second.start()
        deadline = time.monotonic() + 30
        while "waiting for it to finish" not in printed:
            assert second.is_alive() and time.monotonic() < deadline, printed
            time.sleep(0.05)
            printed += capsys.readouterr().out
        assert f"{out} is being prepared by another process (host " in printed and f"pid {os.getpid()})" in printed
        time.sleep(0.3)
        assert second.is_alive() and not result
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == before
    second.join(60)
    printed += capsys.readouterr().out
    assert result == [prepared[1]], printed
    assert f"removed {out / 'meta.json.tmp77'} (1 bytes)" in printed
    assert f"removed {out / 'tokens.bin.tmp4242'} (1,000 bytes)" in printed
    assert "tokens: cached" in printed
    assert sorted(p.name for p in out.iterdir()) == ["a.tmp1x", "draft.tmp2024", "meta.json", "notes.tmp",
                                                     "tokenizer.json", "tokenizer.model", "tokens.bin",
                                                     "tokens.bin.tmp1.csv", "tokens.idx"]


def test_a_lock_whose_directory_is_removed_as_it_is_made_is_taken(tmp_path, monkeypatch):
    """The holder a lock waited for removes the directory it made and its empty parents as it fails: where that
    comes between making the directory and opening its .lock (makedirs, then open: FileNotFoundError), the lock is
    tried again. A path that cannot be made (a dangling link in it) is its error, not a loop."""
    from megatron_mini import files
    made, real = [], os.makedirs

    def removed_once(path, exist_ok=False):
        made.append(path)
        if len(made) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path, exist_ok=exist_ok)
    monkeypatch.setattr(files.os, "makedirs", removed_once)
    lock = files.DirectoryLock(tmp_path / "a" / "b", "a test")
    assert made.count(tmp_path / "a" / "b") == 2 and (tmp_path / "a" / "b" / ".lock").is_file()
    lock.release()
    monkeypatch.undo()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        files.DirectoryLock(tmp_path / "dangling" / "x", "a test")


def test_a_preparation_waiting_for_one_that_failed_builds(prepared, tmp_path):
    """The preparation waited for fails on a new directory, which it removes as it goes (empty but for its .lock):
    the waiting one makes the directory again and builds."""
    import threading
    import time

    from megatron_mini.files import DirectoryLock, remove_empty_dirs

    cfg, meta = prepared
    out = tmp_path / "new" / "out"
    out.mkdir(parents=True)
    result = []
    with DirectoryLock(out, "a test"):
        thread = threading.Thread(target=lambda: result.append(prepare(dataclasses.replace(cfg, dir=str(out)))),
                                  daemon=True)
        thread.start()
        time.sleep(0.5)
    remove_empty_dirs(out, tmp_path)                                  # (the failed one's cleanup)
    thread.join(120)
    assert result and result[0]["corpus_sha256"] == meta["corpus_sha256"]
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "tokenizer.model", "tokens.bin",
                                                     "tokens.idx"]


def test_a_preparation_that_waited_checks_what_the_other_built(prepared, tmp_path):
    """A preparation of another corpus that waited for one building the same new directory refuses, once it has
    the lock, what that one left there, as it would have refused it there before: it never builds over it."""
    import threading
    import time

    from megatron_mini.files import DirectoryLock

    cfg, _ = prepared
    out = tmp_path / "out"
    out.mkdir()
    other = dataclasses.replace(cfg, dir=str(out), source="stdlib")
    outcome = []

    def second():
        try:
            prepare(other)
        except DataError as e:
            outcome.append(e)

    with DirectoryLock(out, "a test"):
        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        time.sleep(0.5)                     # (it waits for the lock: the directory was empty when it began)
        for p in Path(cfg.dir).iterdir():
            shutil.copy(p, out / p.name)    # (the first's build)
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}
    thread.join(60)
    assert outcome and f"holds the corpus {cfg.source}, but data.source=stdlib" in str(outcome[0])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_directory_lock_taken_over_as_its_holder_releases_it(tmp_path, monkeypatch):
    """A process that opened the lock's file just before its holder removed it and unlocked locks a file no longer
    there: it must see that and lock the new one, or two would hold "the" lock at once."""
    import fcntl

    from megatron_mini import files
    from megatron_mini.config import ConfigError

    first = files.DirectoryLock(tmp_path, "a test")
    real, locked = fcntl.flock, []

    def flock_as_the_holder_leaves(f, op):
        if f is not first._file and not locked:
            first.release()                    # (between the second's open and its flock)
        if f is not first._file:
            locked.append(f)
        return real(f, op)

    monkeypatch.setattr(files.fcntl, "flock", flock_as_the_holder_leaves)
    second = files.DirectoryLock(tmp_path, "a test")
    monkeypatch.undo()
    assert len(locked) == 2                    # (it locked twice: the removed file, then the new one)
    with pytest.raises(ConfigError, match="is in use by a third"):
        files.DirectoryLock(tmp_path, "a third")
    second.release()
    assert list(tmp_path.iterdir()) == []


def test_a_file_system_without_locks_is_named(tmp_path, monkeypatch):
    import errno

    from megatron_mini import files
    from megatron_mini.config import ConfigError

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(files.fcntl, "flock", no_locks)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}/.lock cannot be locked (No locks available): its "
                                                    f"file system takes no locks")):
        files.DirectoryLock(tmp_path, "another run")
    assert list(tmp_path.iterdir()) == []                 # (no .lock left: a refused build leaves no directory)
    with pytest.raises(ConfigError, match="its file system takes no locks"):
        prepare(DataConfig(source="stdlib", dir=str(tmp_path / "a" / "b")))
    assert list(tmp_path.iterdir()) == []


def test_a_directory_lock_that_fails_once_taken_is_released(tmp_path, monkeypatch):
    """Writing the holder's name fails (a full disk): the lock is released and its file removed, not held until the
    file object is collected (a traceback holds it)."""
    import errno

    from megatron_mini import files

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.socket, "gethostname", full)
    with pytest.raises(OSError, match="No space left"):
        files.DirectoryLock(tmp_path, "a test")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    files.DirectoryLock(tmp_path, "a test", "").release()


def test_evaluation_note_when_it_reads_the_validation_set_twice(prepared):
    """The evaluation reads samples [0, eval_iters x gbs) of the validation set (as Trainer.evaluate):
    the note comes exactly when that range repeats a sample (a sample read more often than one pass over the set
    holds its tokens: two samples of a corpus can hold the same tokens), and names the largest eval_iters that does
    not."""
    cfg, _ = prepared
    _, val, _ = load_datasets(cfg, SEQ, seed=3, vocab_size=VOCAB)
    once = Counter(tuple(val[i]) for i in range(len(val)))
    gbs = 4
    for eval_iters in (len(val) // gbs, len(val) // gbs + 1):
        read = Counter(tuple(s) for i in range(eval_iters) for s in get_batch(val, i * gbs, gbs, gbs, 0, 1)[0].numpy())
        repeats = any(n > once[s] for s, n in read.items())
        note = evaluation_note(eval_iters, gbs, len(val))
        assert (note is not None) == repeats
    assert f"eval_iters={len(val) // gbs} reads each at most once" in note
    assert "raise data.val_fraction" in evaluation_note(1, len(val) + 1, len(val))
    assert evaluation_note(2, 4, 8) is None and evaluation_note(3, 4, 8) is not None   # exactly the whole set: once


class _Damaged:
    """A dataset whose sample `bad` holds an id past the vocabulary (a damaged tokens.bin in the middle)."""

    def __init__(self, dataset, bad: int):
        self.dataset, self.bad, self.indexed = dataset, bad, dataset.indexed

    def __len__(self):
        return len(self.dataset)

    def locate(self, i):
        return self.dataset.locate(i)

    def __getitem__(self, i):
        row = self.dataset[i]
        if i == self.bad:
            row = row.copy()
            row[3] = 60000
        return row


def _second_step_on_damaged_data(cfg, bad: int):
    from harness import make_trainer
    trainer = make_trainer(cfg)
    trainer.train_data = _Damaged(trainer.train_data, bad)
    trainer.train_step()
    with pytest.raises(DataError) as err:
        trainer.train_step()
    return str(err.value)


@pytest.mark.parametrize("layout, bad", [(dict(tp=2), 20), (dict(), 30)], ids=["tp2", "dp2-rank1-half"])
def test_a_damaged_sample_mid_run_stops_every_rank_at_that_step(small_data, tmp_path, layout, bad):
    """An id past the vocabulary in a later batch (sample 20 or 30 of the second global batch, 16..31) is one
    DataError naming the file, on every rank at the same step, whatever the layout: at tp > 1 the embedding
    took it for another rank's id and trained on a zero row; at dp = 2 only the rank that read it failed (tp = 1:
    an IndexError in the embedding)."""
    from harness import small_config
    from ranks import spawn
    cfg = dataclasses.replace(small_config(small_data, tmp_path), **layout)
    messages = spawn(2, _second_step_on_damaged_data, cfg, bad, timeout=300)
    assert messages[0] == messages[1], messages
    assert f"tokens.bin: holds token id 60000, outside the vocabulary of 512 (in sample {bad})" in messages[0]


def test_get_batch_checks_the_whole_global_batch_on_every_rank(prepared):
    """With the vocabulary given, each DP rank reads the whole global batch and refuses a bad id in any rank's
    share (the same verdict everywhere), and still returns only its own share."""
    cfg, _ = prepared
    train, _, _ = load_datasets(cfg, SEQ, seed=3, vocab_size=VOCAB)
    damaged = _Damaged(train, 13)                   # in DP rank 1's half of samples 8..15
    for rank in (0, 1):
        with pytest.raises(DataError, match=r"\(in sample 13\)"):
            get_batch(damaged, 8, 8, 2, rank, 2, (VOCAB, cfg))
        assert get_batch(train, 8, 8, 2, rank, 2, (VOCAB, cfg)).equal(get_batch(train, 8, 8, 2, rank, 2))
    assert get_batch(damaged, 0, 8, 2, 1, 2, (VOCAB, cfg)).shape == (2, 2, SEQ + 1)    # samples 0..7: clean
