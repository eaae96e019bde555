"""Test session setup: CPU-only Triton runs through the interpreter, set before any Triton import."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")   # read when torch is imported
os.environ.setdefault("WANDB_MODE", "disabled")

import signal  # noqa: E402

import torch  # noqa: E402

# A shell starts a background job (`make test &`) with SIGINT ignored, and nohup (`nohup make test &`) SIGHUP too,
# which every process it starts inherits, and the library leaves a signal it was started ignoring ignored
# (launch.StopRequest.taken): the tests of Ctrl-C and of a closed terminal then saw none. They test the library's
# answer to those, so the session takes SIGINT and SIGHUP as a terminal's process does.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """A small prepared dataset (60 standard-library modules as .txt, tests/corpus.py; vocabulary 512): its
    DataConfig."""
    from corpus import FIRST_60, write_modules
    from megatron_mini.config import DataConfig
    from megatron_mini.data import prepare

    root = tmp_path_factory.mktemp("small_data")
    corpus = write_modules(root / "corpus", FIRST_60)
    cfg = DataConfig(source=str(corpus), dir=str(root / "data"), vocab_size=512, tokenizer_sample_chars=2_000_000,
                     val_fraction=0.05, num_workers=1)
    prepare(cfg)
    return cfg


@pytest.fixture(scope="session")
def hooks(tmp_path_factory):
    """A directory holding the test hooks' sitecustomize.py (tests/commandline.py) for launched runs."""
    from commandline import SITECUSTOMIZE

    d = tmp_path_factory.mktemp("hooks")
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return d


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_basetemp(tmp_path_factory):
    """The session's subprocesses (launched runs, ranks) make their temporary files under pytest's basetemp,
    which pytest prunes, not in /tmp: torchrun makes a log directory there on every launch (torchelastic_*,
    its ranks' error.json files) and never removes it (47 in a suite)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
        yield
