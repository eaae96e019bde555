"""Build the tokenizer and token dataset for `data.*` (default: the Python standard library).

    python tools/prepare_data.py                       # = make data
    python tools/prepare_data.py data.source=corpus.jsonl data.dir=data/mine data.vocab_size=4096

Writes tokenizer.model, tokens.bin/.idx and meta.json into data.dir; steps whose output is
already valid are skipped (see megatron_mini.data.prepare).
"""
import sys

import hydra
from omegaconf import OmegaConf

from megatron_mini.config import ConfigError, check_keys, check_ranges, register_configs
from megatron_mini.data import DataError, prepare
from megatron_mini.launch import HydraCommandLine, fail

register_configs()
command_line = HydraCommandLine()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(dict_cfg) -> None:
    command_line.composed()
    try:
        check_keys(OmegaConf.to_container(dict_cfg, resolve=False))   # (train.py's checks of the data.* keys)
        cfg = OmegaConf.to_object(dict_cfg)
        check_ranges(cfg, "data.")
        prepare(cfg.data)
    except (ConfigError, DataError) as e:
        fail(str(e), code=2)


if __name__ == "__main__":
    # Hydra creates its run dir: make it data.dir (created anyway) rather than an empty runs/<run_name>.
    if not any(arg.startswith("hydra.run.dir=") for arg in sys.argv[1:]):
        sys.argv.append("hydra.run.dir=${data.dir}")
    command_line.run(main)
