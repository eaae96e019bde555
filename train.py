"""Train a GPT with megatron_mini.

    torchrun --nproc_per_node=2 train.py                      # the tiny model, data parallel on CPU
    torchrun --nproc_per_node=8 train.py tp=2 pp=2 sp=true    # 3D: tp=2 x pp=2 x dp=2
    torchrun --nproc_per_node=48 train.py layout=tp4_pp12 model=gpt2-small

Hydra composes conf/config.yaml with the command line into one typed TrainConfig
(megatron_mini/config.py). Every failure the run can explain ends every rank with one line,
`error: ...`, which torchrun's report also names as the root cause (megatron_mini.launch.fail):
Hydra's own messages (a wrong type, a value outside a choice), unknown keys, and the library's
ConfigError / RunError / CommError. Any other exception is a bug: its traceback, on its rank's stderr, is the
root cause of torchrun's report too.
"""
import os
import sys
import traceback


def quiet_interrupt(kind, value, tb) -> None:
    """sys.excepthook: Ctrl-C before train() takes it as a request to stop (each rank imports torch, reads the data:
    seconds), or a second one during it, ends the command without a traceback (every rank printed one); Python then
    ends by SIGINT (a shell's 130). Any other exception is printed as always."""
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)


sys.excepthook = quiet_interrupt     # (first: the imports below take seconds too)

from megatron_mini.launch import EarlyInterrupt   # (milliseconds: no torch)

EarlyInterrupt.install()             # (a Ctrl-C that an import's callback swallows is raised again by train())

import hydra
from omegaconf import DictConfig

from megatron_mini.checkpoint_dir import check_start_dirs
from megatron_mini.config import TrainConfig, check_given, register_configs, structured, validate
from megatron_mini.dataset import load_run_data
from megatron_mini.errors import CommError, ConfigError, RunError, first_line, peer_closed
from megatron_mini.launch import HydraCommandLine, Terminated, fail, follow_parent, launch_env, write_error_file

register_configs()
command_line = HydraCommandLine(multirun=False)     # (a sweep is refused: each run is a job of its own ranks)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(dict_cfg: DictConfig) -> None:
    command_line.composed()
    try:
        check_given(dict_cfg, command_line.argv)
        cfg: TrainConfig = structured(dict_cfg)
        # a bad config is refused in well under a second: torch is not loaded yet (a ramp's batches: from sample 0
        # unless the run may resume, when train() checks them from its checkpoint's)
        _, world_size, _, ranks_here = launch_env()
        validate(cfg, world_size, consumed_samples=0 if cfg.resume == "never" else None)
        check_start_dirs(cfg, world_size, ranks_here)   # (nor a resume=PATH or init_from that is not there)
        datasets = load_run_data(cfg)      # (no torch either: a data directory missing or broken is refused as fast)
        from megatron_mini.training import train
        train(cfg, datasets)
    except ConfigError as e:               # every rank finds the same problem before any collective
        fail(str(e), code=2)
    except RunError as e:                  # every rank knows; one of them says what it was
        fail(str(e), code=1, reporter=e.reporter)
    except CommError as e:                 # this rank's collective failed: say so at once (unless a peer ended)
        fail(str(e), code=1, reporter=None, peer_ended=peer_closed(e))
    except Terminated:                     # stopped by the launcher because of another rank's failure
        os._exit(143)
    except KeyboardInterrupt:              # a second Ctrl-C (the first asks for a save): at once, silent as before
        sys.excepthook = quiet_interrupt   # train(), though wandb.init wrapped the hook in one that prints it
        raise
    except Exception as e:                 # a bug: its traceback is torchrun's root cause too (Hydra prints it)
        write_error_file(first_line(e), traceback.format_exc())
        raise


if __name__ == "__main__":
    follow_parent()      # (first: a torchrun worker whose launcher dies as it imports torch, seconds, stops too)
    command_line.run(main)
