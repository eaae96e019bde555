"""Build the tokenizer and token dataset for `data.*` (default: the Python standard library).

    python tools/prepare_data.py                       # = make data
    python tools/prepare_data.py data.source=corpus.jsonl data.dir=data/mine data.vocab_size=4096
    python tools/prepare_data.py data.source=shards/ data.text_key=content data.dir=data/shards   # *.jsonl(.gz), *.txt
    python tools/prepare_data.py data.source=code.jsonl data.dir=data/code data.vocab_size=4096 \
        data.tokenizer=data/mine/tokenizer.model                      # encoded with mine's tokenizer: blendable
    python tools/prepare_data.py 'data.blend=[0.7,data/mine,0.3,data/code]' data.vocab_size=4096   # checks a blend

Writes tokenizer.model, tokens.bin/.idx and meta.json into data.dir; steps whose output is
already valid are skipped (see megatron_mini.data.prepare). With data.blend, builds nothing: each of its
directories must already be prepared, all with one tokenizer (each after the first with data.tokenizer=<the
first's>/tokenizer.model), and the mixture is printed;
data.source, data.text_key and data.tokenizer beside it are refused (check_ranges), as train.py refuses them.
"""
import hydra

from megatron_mini.config import ConfigError, check_given, check_ranges, register_configs, structured
from megatron_mini.data import DataError, prepare
from megatron_mini.dataset import blend_note, load_datasets
from megatron_mini.launch import HydraCommandLine, Stopped, fail, stop_on_signals

register_configs()
command_line = HydraCommandLine()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(dict_cfg) -> None:
    command_line.composed()
    stop_on_signals()                      # (SIGTERM: the tokens.bin being written is removed, not left behind)
    try:
        check_given(dict_cfg, command_line.argv)                     # (train.py's checks of the data.* keys)
        cfg = structured(dict_cfg)
        check_ranges(cfg, "data.")
        cfg.data.check_dirs_on_disk()
        if cfg.data.blend is None:
            prepare(cfg.data)
        else:                              # (the samples of the mixture it prints: a run's seq_len and seed)
            check_ranges(cfg, "model.seq_len")
            check_ranges(cfg, "seed")
            print(blend_note(load_datasets(cfg.data, cfg.model.seq_len, cfg.seed, cfg.data.vocab_size)[0]))
    except (ConfigError, DataError) as e:
        fail(str(e), code=2)
    except OSError as e:                   # checked writable before the build: a full disk, a corpus file unread
        fail(f"{e.filename or dict_cfg.data.dir}: {e.strerror or e}", code=2)
    except Stopped as e:
        fail(f"stopped by {e}: no half-written file is left; what was finished (a tokenizer) is kept, and the "
             f"same command goes on from there.", code=128 + e.signum)


if __name__ == "__main__":
    command_line.run(main)    # (Hydra's run dir is conf/config.yaml's ".": it creates no directory)
