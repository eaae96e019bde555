"""Train a GPT with megatron_mini.

    torchrun --nproc_per_node=2 train.py                      # the tiny model, data parallel on CPU
    torchrun --nproc_per_node=8 train.py tp=2 pp=2 sp=true    # 3D: tp=2 x pp=2 x dp=2
    torchrun --nproc_per_node=48 train.py layout=tp4_pp12 model=gpt2-small

Hydra composes conf/config.yaml with the command line into one typed TrainConfig
(megatron_mini/config.py); unknown keys and wrong types fail before anything starts.
"""
import os
import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from megatron_mini.config import ConfigError, TrainConfig, register_configs
from megatron_mini.mesh import launch_env

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(dict_cfg: DictConfig) -> None:
    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
    rank = launch_env()[0]
    try:
        from megatron_mini.training import train
        train(cfg)
    except ConfigError as e:
        # Every rank finds the same problem before any collective. Rank 0 reports it; the others
        # wait for torchrun to stop them once rank 0 has exited (or report it themselves if not).
        if rank != 0:
            time.sleep(15)
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)


if __name__ == "__main__":
    main()
