"""Train a GPT with megatron_mini.

    torchrun --nproc_per_node=2 train.py                      # the tiny model, data parallel on CPU
    torchrun --nproc_per_node=8 train.py tp=2 pp=2 sp=true    # 3D: tp=2 x pp=2 x dp=2
    torchrun --nproc_per_node=48 train.py layout=tp4_pp12 model=gpt2-small

Hydra composes conf/config.yaml with the command line into one typed TrainConfig
(megatron_mini/config.py); unknown keys and wrong types fail before anything starts.
"""
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from megatron_mini.config import ConfigError, TrainConfig, register_configs
from megatron_mini.mesh import launch_env

register_configs()


def write_config(cfg: DictConfig, run_dir: str) -> None:
    """Rank 0 alone records the composed config (ranks must not race on one file)."""
    os.makedirs(os.path.join(run_dir, ".hydra"), exist_ok=True)
    tmp = os.path.join(run_dir, ".hydra", "config.yaml.tmp")
    with open(tmp, "w") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    os.replace(tmp, os.path.join(run_dir, ".hydra", "config.yaml"))


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(dict_cfg: DictConfig) -> None:
    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
    rank = launch_env()[0]
    try:
        if rank == 0:
            write_config(dict_cfg, cfg.run_dir)
        from megatron_mini.training import train
        train(cfg)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)  # every rank leaves at once, before any collective can wait for it


if __name__ == "__main__":
    main()
