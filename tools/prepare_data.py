"""Build the tokenizer and token dataset for `data.*` (default: the Python standard library).

    python tools/prepare_data.py                       # = make data
    python tools/prepare_data.py data.source=corpus.jsonl data.dir=data/mine data.vocab_size=4096

Writes tokenizer.model, tokens.bin/.idx and meta.json into data.dir; steps whose output is
already valid are skipped (see megatron_mini.data.prepare).
"""
import sys

import hydra
from omegaconf import OmegaConf

from megatron_mini.config import register_configs
from megatron_mini.data import DataError, prepare

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg) -> None:
    try:
        prepare(OmegaConf.to_object(cfg.data))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    # Hydra creates its run dir: make it data.dir (created anyway) rather than an empty runs/<run_name>.
    if not any(arg.startswith("hydra.run.dir=") for arg in sys.argv[1:]):
        sys.argv.append("hydra.run.dir=${data.dir}")
    main()
