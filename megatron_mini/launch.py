"""The process around training: the launcher's environment, how a run fails, signals, the run lock.

* `launch_env()`: rank, world size, local rank and local world size from torchrun or SLURM;
  `gpu_slot()`: which of the GPUs this process sees are its own; `free_port()`: a MASTER_PORT for ranks
  started together on this machine (the tests, the benchmarks).
* `fail(message, code, reporter)`: the one way a rank ends on an error it can explain. The reporting
  rank (0 by default) prints `error: <message>` at once; the others wait, so that when every rank
  knows the same problem the message is printed once (torchrun stops them when the reporter exits; ranks started
  without it, in a gloo group, see it end and exit with it: `reporter_ended`).
  reporter=None prints at once on this rank, for failures that are not shared (a collective that
  timed out). The message also goes to torchrun's error file ($TORCHELASTIC_ERROR_FILE, `write_error_file`, which
  train.py also gives a bug's traceback), so the "Root Cause" section of torchrun's report names it instead of
  `error_file: <N/A>`; a rank whose peer ended (`peer_closed`) leaves that section to the peer.
* `follow_parent()`: a torchrun worker whose launcher dies gets SIGTERM (Linux parent-death signal), so it
  stops (after saving, see `StopRequest`) instead of training on as an orphan. Asked for as early as it can be
  (train.py: before torch is imported): a launcher that died before is not seen (its pid is read there).
* `StopRequest`: SIGTERM (preemption, Slurm's warning, the launcher going away), SIGINT (Ctrl-C), SIGHUP (the
  terminal or ssh session gone), which torchrun forwards to its workers as it gets them, or SIGUSR1 (Slurm's
  `--signal=USR1@SECONDS` warning) sets a flag that the training loop shares with every rank at the end of a
  step; then all of them save and exit. A second SIGINT interrupts at once. Its deadline (exit_after_minutes,
  a job's time limit less a margin) asks the same once it has passed. train() takes the signals once the ranks have
  met; until then SIGTERM, SIGINT and SIGHUP end a rank of a job at once (StopRequest.take).
* `EarlyInterrupt`: SIGINT's handler from train.py's first line until train() takes the signal: Python's
  KeyboardInterrupt, which a callback (a weakref's, a `__del__`) would swallow, remembered, and raised again by
  train().
* `stop_on_signals()`: outside training (tools/prepare_data.py), SIGTERM, SIGINT and SIGHUP raise `Stopped`, so
  that what the command was writing is taken away as it unwinds, not left on disk by SIGTERM's default action;
  `signals_held()` keeps them out of code that must not be cut in two.
* `RunLock`: one run per run directory (files.DirectoryLock: an exclusive `flock`, released by the kernel when its
  process dies, so a crash leaves no stale lock).
* `HydraCommandLine`: runs a `@hydra.main` entry point (train.py, tools/prepare_data.py) so that a command
  line Hydra refuses ends with one `error:` line too; `hydra_parser_allowed()`: Hydra 1.3's parser on Python 3.14.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import random
import re
import signal
import socket
import sys
import threading
import time

from .errors import ConfigError, first_line, peer_closed
from .files import DirectoryLock, atomic_write

# how long ranks other than 0 wait before printing a shared error themselves (rank 0 usually exits
# first and torchrun stops them; they print only if rank 0 is slower or stuck)
OTHER_RANKS_WAIT_S = 15


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer: a launcher (torchrun, srun) sets it to this "
                          f"process's place in the job; unset it to run one process.") from None


def launch_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's variables, else SLURM's,
    else a single process. A variable that is no integer, or a rank outside [0, world size), is a
    ConfigError (a stale RANK in the shell waited for ranks that never came); so is LOCAL_RANK without
    LOCAL_WORLD_SIZE (each rank of a node would count LOCAL_RANK + 1 ranks there, and choose its device and
    backend from another count than its neighbours), a MASTER_PORT or MASTER_ADDR the rendezvous cannot use,
    and no MASTER_ADDR for a job on several nodes: refused on every rank before any of them waits."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" not in env:
            raise ConfigError("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not: the device choice needs "
                              "the number of processes on this node, the same on each of them (torchrun sets "
                              "both); set LOCAL_WORLD_SIZE, or launch with torchrun.")
        found = (_int_env("RANK", 0), _int_env("WORLD_SIZE", 1), _int_env("LOCAL_RANK", 0),
                 _int_env("LOCAL_WORLD_SIZE", 1))
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        found = (_int_env("SLURM_PROCID", 0), _int_env("SLURM_NTASKS", 1), _int_env("SLURM_LOCALID", 0),
                 _slurm_tasks_here())
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "tasks on this node")
    else:
        return 0, 1, 0, 1
    for i in (0, 2):                   # (rank, world size), then (local rank, local world size)
        rank, size = found[i], found[i + 1]
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"{names[i]}={rank} with {names[i + 1]}={size}: a launcher (torchrun, srun) sets these "
                              f"to this process's place in the job, a rank in [0, size); unset them to run one "
                              f"process.")
    port, address = env.get("MASTER_PORT"), env.get("MASTER_ADDR")
    if found[1] > 1 and port is not None and not (re.fullmatch(r"\s*[0-9]+\s*", port) and 1 <= int(port) <= 65535):
        raise ConfigError(f"MASTER_PORT={port!r} is not a TCP port (1 to 65535): the ranks meet rank 0 at "
                          f"MASTER_ADDR:MASTER_PORT; set it to a free port (or unset it: 29500).")
    if found[1] > 1 and address is not None and not address.strip():
        raise ConfigError("MASTER_ADDR is empty: the ranks meet rank 0 at MASTER_ADDR:MASTER_PORT; set it to rank 0's "
                          "host (or unset it: 127.0.0.1, one node).")
    # every node holding fewer ranks than the job, all of them see it (when the launcher says how many a node holds)
    if found[1] > found[3] and address is None and (names[0] == "SLURM_PROCID" or "LOCAL_WORLD_SIZE" in env):
        raise ConfigError(f"this job spans several nodes ({found[1]} ranks, {found[3]} on this one) but MASTER_ADDR "
                          f"is not set, so each node would meet at its own 127.0.0.1: set it to rank 0's host (under "
                          f"SLURM: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)), "
                          f"and start every rank with srun or torchrun, not python in the batch script.")
    return found


def _slurm_tasks_here() -> int:
    """How many tasks of this job step run on this node: entry SLURM_NODEID of the step's tasks per node
    (SLURM_STEP_TASKS_PER_NODE, else the job's SLURM_TASKS_PER_NODE), a list like `4(x2),2` for 4, 4, 2.
    Every task of a node reads the same entry, so all of them make the same device choice."""
    env = os.environ
    node = _int_env("SLURM_NODEID", 0)
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = []
        for part in env.get(name, "").split(","):
            match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if match is None:
                counts = []
                break
            counts += [int(match[1])] * int(match[2] or 1)
        if node < len(counts):
            return counts[node]
    raise ConfigError("SLURM sets SLURM_PROCID here but neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE "
                      f"(e.g. 4(x2),2) gives this node's (SLURM_NODEID={node}) number of tasks, which the device "
                      "choice needs; launch with srun inside an allocation (sbatch/salloc), or with torchrun.")


def gpu_slot() -> tuple[int, int]:
    """(this rank's index among the ranks that see the same GPUs, how many ranks see them): the local
    rank and local world size, except under SLURM with GPUs bound per task (--gpus-per-task, which
    sets SLURM_GPUS_PER_TASK and gives each task its own CUDA_VISIBLE_DEVICES): (0, 1)."""
    _, _, local_rank, local_world_size = launch_env()
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and env.get("SLURM_GPUS_PER_TASK"):
        return 0, 1
    return local_rank, local_world_size


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
PORT_PICKS = random.SystemRandom()      # free_port's: not the seeded generator a test may have set


def free_port(low: int = 20000) -> int:
    """A TCP port nothing on this machine is bound to now, for ranks that meet at it (MASTER_PORT).

    Taken at random from [low, the kernel's ephemeral range): a port from bind(0) is an ephemeral one, which
    the kernel may give to any outgoing connection (a gloo pair's, a store client's) before rank 0 listens on it
    (EADDRINUSE). Linux reads that range from net.ipv4.ip_local_port_range; elsewhere the ranges start at 32768
    (BSD) or 49152 (macOS, Windows). Where the ephemeral range starts at or below `low`, bind(0)'s port is the
    answer."""
    try:
        with open(EPHEMERAL_PORTS) as f:
            high = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    for _ in range(100 if high > low else 0):
        port = PORT_PICKS.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("", port))      # all addresses, as the store listens: a socket on any of them is a clash
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun's agent started (and stops when another worker fails)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def write_error_file(message: str, traceback: str | None = None) -> None:
    """Hand `message` (and the `traceback` of an exception no one explains, a bug's) to torchrun (its per-rank error
    file), which shows it as the root cause: the failure whose file is the earliest (in whole seconds; a rank
    without one counts from when torchrun saw it end). Whole or not at all (files.atomic_write): torchrun's agent
    reads it as JSON, and one cut short (this rank killed while it wrote, as torchrun stops the others when one
    fails) made the agent itself fail, so --max-restarts never restarted."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:        # torchrun's format (errors.ErrorHandler, as its errors.record writes); its report shows "py_callstack"
        atomic_write(path, json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": traceback or message, "timestamp": str(int(time.time()))}}}))
    except OSError:
        pass


def fail(message: str, code: int = 2, reporter: int | None = 0, peer_ended: bool = False) -> None:
    """Print `error: message` (once per job, see the module doc), tell torchrun, exit with `code`. `peer_ended`: this
    rank failed because another one ended (errors.peer_closed), whose end is the job's root cause: under torchrun,
    which stops this rank as soon as it sees that end, this rank says nothing for OTHER_RANKS_WAIT_S (at once, its
    error file was as early as the other's in torchrun's whole seconds, and took the root cause from a crash's
    traceback)."""
    for signum in StopRequest.taken():      # torchrun stopping the job now ends this rank at once
        signal.signal(signum, signal.SIG_DFL)
    try:
        rank = launch_env()[0]
    except ConfigError:                                 # (the launcher's variables are what failed)
        rank = reporter
    if peer_ended and under_torchrun():
        time.sleep(OTHER_RANKS_WAIT_S)
    said = reporter is not None and rank != reporter and reporter_ended(reporter, OTHER_RANKS_WAIT_S)
    write_error_file(message)
    if not said:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def reporter_ended(reporter: int, seconds: float) -> bool:
    """Wait up to `seconds` for rank `reporter` to end, which it does once it has printed the error this rank would:
    True as soon as it has, where the ranks were started without torchrun (as srun starts them: nothing stops the
    others when the reporter exits) and their process group is gloo's (a receive from it fails as its connections
    close); False after `seconds` otherwise (torchrun stops this rank first, as soon as the reporter exits: its
    report then names one failure, not this one too; no group yet; NCCL's, which sees no peer end)."""
    dist = sys.modules.get("torch.distributed")
    if under_torchrun() or dist is None or not dist.is_initialized() or \
            dist.get_backend() != "gloo":
        time.sleep(seconds)
        return False
    import torch
    ended = threading.Event()

    def receive():
        try:
            dist.recv(torch.empty(1), src=reporter)     # (never sent)
        except Exception as e:     # noqa: BLE001 - its connection closed, not the group's timeout_s passed
            if peer_closed(e):
                ended.set()
    threading.Thread(target=receive, daemon=True).start()
    return ended.wait(seconds)


def follow_parent() -> None:
    """Ask Linux for SIGTERM when the parent (torchrun's agent) dies; exit now if it already has. Only in a
    torchrun worker: the parent of `python train.py` is a shell, which a run started with nohup (or &, disown)
    must outlive."""
    if not under_torchrun():
        return
    if not signal_at_parent_death(signal.SIGTERM, os.getppid()):
        fail("the launcher of this worker exited before training started.", code=1, reporter=None)


def signal_at_parent_death(signum: int, parent: int) -> bool:
    """Ask Linux to send this process `signum` when its parent dies (PR_SET_PDEATHSIG). False when `parent` (the
    parent's pid, read earlier) died before the request was in place: this process is an orphan already. True
    otherwise, and where nothing can be asked (not Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)      # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):                           # not Linux: no parent-death signal
        return True
    return os.getppid() == parent


class Terminated(Exception):
    """A collective failed after this rank was told to stop (SIGTERM): the launcher is ending the job
    because of a failure elsewhere, which that rank reports; this one exits quietly."""


class StopRequest:
    """SIGTERM, SIGINT, SIGHUP or SIGUSR1 (Slurm's `--signal=USR1@SECONDS` warning, sent to every task) sets
    `requested` (and `name`, the first signal's); the training loop decides, with every rank, to save and stop
    (`asked`: why this rank asks, a signal or the `deadline`, a time.monotonic() time, having passed). After a
    SIGINT, the next one raises KeyboardInterrupt (Ctrl-C twice: stop now). A signal this process was started
    ignoring (nohup's SIGHUP, a script's background job's SIGINT) stays ignored. `close()` gives every signal back
    the handler it had before (train() does, as it returns: Ctrl-C after it is a KeyboardInterrupt again).
    Signals are taken only where Python can (`take_signals`: the main thread)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
    TIME_LIMIT = "exit_after_minutes"
    REASONS = tuple(s.name for s in SIGNALS) + (TIME_LIMIT,)      # (what `asked` returns)

    def __init__(self, deadline: float | None = None, take_signals: bool = True):
        self.requested, self.name, self.deadline, self.previous = False, None, deadline, {}
        if take_signals:
            self.take()

    def take(self, signals: tuple = SIGNALS, handler=None) -> None:
        """From now on, `signals` are requests to stop, or call `handler` (SIG_DFL: end the process at once); close()
        gives each the handler it had before the first call. Only in the main thread (the only one where Python
        takes signals). A Ctrl-C that came before and was lost (EarlyInterrupt) raises its KeyboardInterrupt here."""
        for signum in self.taken(signals):
            self.previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self._handle if handler is None else handler)
        EarlyInterrupt.raise_if_lost(self.previous.get(signal.SIGINT))

    def asked(self) -> str | None:
        """Why this rank asks the run to stop: the first signal's name, TIME_LIMIT once the deadline has passed,
        or None."""
        if self.requested:
            return self.name
        return self.TIME_LIMIT if self.deadline is not None and time.monotonic() >= self.deadline else None

    def close(self) -> None:
        """Give each signal taken back the handler it had before."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}

    @classmethod
    def taken(cls, signals: tuple = SIGNALS) -> list:
        """The signals of `signals` this process handles: those it was not started ignoring (SIGTERM always)."""
        return [s for s in signals if s == signal.SIGTERM or signal.getsignal(s) is not signal.SIG_IGN]

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.name = self.name or signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)


class EarlyInterrupt:
    """SIGINT's handler from a command's start (train.py's first lines) until train() takes the signal: it raises
    KeyboardInterrupt, as Python's own handler does, and remembers that it came. Python cannot pass on an exception
    raised in a callback (a weakref's, a `__del__`; the import system runs some as a module is imported): it prints
    "Exception ignored in: ..." and goes on. So that Ctrl-C was lost: the command went on to train, and a rank of a
    job, with torchrun forwarding the Ctrl-C to every rank, waited in the rendezvous for the ranks it had ended,
    until torchrun's SIGKILL 30 s later. `raise_if_lost` (train(), StopRequest.take) raises it again."""

    def __init__(self):
        self.came = False

    def __call__(self, signum, frame):
        self.came = True
        raise KeyboardInterrupt

    @classmethod
    def install(cls) -> None:
        """SIGINT's handler from now on, where it is Python's own (not where the process was started ignoring it:
        nohup, a script's background job)."""
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, cls())

    @staticmethod
    def raise_if_lost(handler) -> None:
        """KeyboardInterrupt where `handler` (SIGINT's, now or before) is an EarlyInterrupt that came: the process is
        still here, so a callback swallowed it."""
        if isinstance(handler, EarlyInterrupt) and handler.came:
            raise KeyboardInterrupt


STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)     # what stop_on_signals takes
_held = {"depth": 0, "signum": None}   # signals_held's blocks open, and the first signal stop_on_signals deferred


class Stopped(BaseException):
    """This process was sent SIGTERM, SIGINT or SIGHUP (`stop_on_signals`); `signum` is which. A BaseException,
    as KeyboardInterrupt is: no `except Exception` takes it for a failure of the work in hand."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals() -> None:
    """Make SIGTERM, SIGINT and SIGHUP raise Stopped in the main thread (a signal the process was started ignoring
    stays ignored). SIGTERM's default action ends the process where it stands, leaving what it was writing (a
    temporary file of gigabytes, a directory it created); raised, the work unwinds, and its `except BaseException`
    and `finally` clauses take those away. For a command line outside training: train() takes these signals itself
    (StopRequest), to save and stop with every rank."""
    def stop(signum, frame):
        if _held["depth"]:
            _held["signum"] = _held["signum"] or signum
        else:
            raise Stopped(signum)
    for signum in StopRequest.taken(STOPPING):
        signal.signal(signum, stop)


@contextlib.contextmanager
def signals_held(signals: tuple = STOPPING):
    """Hold `signals` within the block; one that came raises its Stopped as the block ends. For code that a Stopped
    raised by stop_on_signals must not cut in two, such as a process pool's bookkeeping as it starts a worker (a pool
    left half-updated waits forever in its shutdown). Two holds: this thread blocks them (pending, not lost), so a
    process started within inherits the block, never sees them, and stops as the pool is shut down; and the handler
    defers a signal that came anyway (the kernel gives a signal sent to the process to any thread not blocking it,
    and Python then runs the handler in the main thread, within the block)."""
    _held["depth"] += 1             # (first: from here on the handler defers, so nothing below is cut short)
    previous = None
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)     # (a pending signal's handler runs here)
        signum = None
        if _held["depth"] == 1:     # (taken while still held: a signal from now on is deferred, or raised once out)
            signum, _held["signum"] = _held["signum"], None
        _held["depth"] -= 1
        if signum is not None:
            raise Stopped(signum)


class RunLock(DirectoryLock):
    """One run per run directory: a DirectoryLock on `{run_dir}/.lock`, held for the life of the process (or until
    release())."""

    def __init__(self, run_dir: str):
        super().__init__(run_dir, "another run", "Two runs must not share a run directory: wait for it to finish, "
                                                 "or choose another one with run_name=NAME (or run_dir=PATH).")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def missing_option(text: str, argv: list) -> str | None:
    """Hydra's report (on one line) of a config group given a name it has no file for (model=nope), as one short
    line with the names it has, and the config file that chose it where the command line `argv` did not (a
    default); None for any other report."""
    found = re.search(r"(?:In '([^']+)': )?Could not find '([^'/]+)/([^']*)' Available options in '[^']+': (.*?)"
                      r"(?: Config search path|$)", text)
    if not found:
        return None
    chooser, group, name, names = found.groups()
    typed = f"{group}={name}" in (arg.lstrip("+~").replace(" ", "") for arg in argv)
    where = f" (chosen in {chooser})" if chooser and not typed else ""
    return f"{group}={name}{where}: {group} has no option {name}; its options are {', '.join(names.split())}"


@contextlib.contextmanager
def hydra_parser_allowed():
    """Within it Hydra 1.3 builds its command-line parser on Python 3.14 too: 3.14's argparse checks each option's
    help as it is added (ArgumentParser._check_help, a %-format of it), and Hydra gives --shell-completion a help
    that is an object making its text only when shown, which that check refuses, so every Hydra command line ended
    in `ValueError: badly formed help string` (hydra#3121; Hydra's fix after 1.3 skips the check the same way).
    Here a help that is not a string goes unchecked; a string is checked as before. Before 3.14: nothing to do."""
    check = getattr(argparse.ArgumentParser, "_check_help", None)
    if check is None:
        yield
        return

    def check_strings(parser, action):
        if action.help is None or isinstance(action.help, str):
            check(parser, action)

    argparse.ArgumentParser._check_help = check_strings
    try:
        yield
    finally:
        argparse.ArgumentParser._check_help = check


class HydraCommandLine:
    """Runs a `@hydra.main` entry point so that a command line Hydra refuses (a wrong type, a value outside
    a choice, an unknown key) ends with one line, `error: ...` (exit 2), not Hydra's report on every rank:
    what Hydra prints while it composes the config is held, and given back by `composed()`, which the entry
    point calls first; then stderr is the real one again. `multirun=False` (train.py): Hydra's sweeps (-m, and
    every other way to ask for one) are refused before Hydra's sweeper writes anything (but for a Hydra whose
    parser is not where 1.3 has it: then as the entry point starts, after). Hydra's output (HYDRA_OUTPUT) is off
    whatever the primary config says."""
    HINT = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
    TRACEBACK = "Traceback (most recent call last)"
    CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    MULTIRUN = ("multirun (-m) is not supported: each run is a job of its own ranks (one process group, one run "
                "directory); launch one command per configuration (a shell loop, or a scheduler's array job), each "
                "with its own run_name.")
    MULTIRUN_MODES = ("MULTIRUN", "RunMode.MULTIRUN", "2")     # (the spellings of hydra.mode that OmegaConf takes)
    # Hydra's output settings that conf/config.yaml turns off, with the values that keep them off: Hydra would write
    # into the starting directory (every rank of a job, racing) or move the process out of it
    HYDRA_OUTPUT = {"hydra.run.dir": (".", "./"), "hydra.job.chdir": ("false", "null"),
                    "hydra.output_subdir": ("null",), "hydra/job_logging": ("disabled",),
                    "hydra/hydra_logging": ("disabled",)}
    OUTPUT = ("Hydra's output directory is off for this command (conf/config.yaml: hydra.run.dir is ., no .hydra "
              "copy, no change of the working directory, no log of Hydra's): a run writes into run_dir (runs/"
              "<run_name>, or run_dir=PATH), its config to run_dir/.hydra/config.yaml and its logs to run_dir/logs, "
              "and relative paths (data.dir, run_dir) are read from the directory the command starts in.")

    def __init__(self, conf: str = CONF, config_name: str = "config", argv: list | None = None, schema=None,
                 multirun: bool = True):
        self.conf = conf                       # the config directory: its subdirectories are the config groups
        self.config_name = config_name         # the command's own config, conf/<config_name>.yaml
        self.schema = schema                   # its dataclass (TrainConfig where None): the keys it has
        self.multirun = multirun               # whether Hydra may sweep (run several jobs in this process)
        self.real = self.held = None
        self.argv = argv or []

    def composed(self, replay: bool = True) -> None:
        """The entry point's first call: stderr is the real one again (with what Hydra printed, `replay`), and a
        sweep that no command-line flag asked for (hydra.mode in a --config-dir config) is refused."""
        if self.held is not None and sys.stderr is self.held:
            sys.stderr = self.real
            if replay:
                self.real.write(self.held.getvalue())
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        if HydraConfig.initialized():
            hydra = HydraConfig.get()
            if not self.multirun and hydra.mode == RunMode.MULTIRUN:
                fail(self.MULTIRUN, code=2)
            if os.path.realpath(os.getcwd()) != os.path.realpath(hydra.runtime.cwd):
                fail(f"hydra.job.chdir=true moved this command into {hydra.runtime.output_dir}: {self.OUTPUT}", code=2)

    def hydra_args(self):
        """The command line `argv` as Hydra's own parser reads it (its abbreviations, -m joined to other flags:
        `--multi`, `-mc job`; overrides given apart from the first ones left for Hydra to refuse), or None where that
        parser refuses it (Hydra then says why itself) or is not where Hydra 1.3 has it (a sweep is then refused by
        `composed`, as the entry point starts, after the sweeper wrote its directory; and output_off adds nothing)."""
        try:
            from hydra._internal.utils import get_args_parser
        except ImportError:
            return None
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                    hydra_parser_allowed():
                return get_args_parser().parse_known_args(self.argv)[0]   # (overrides apart from the others: Hydra's)
        except SystemExit:                     # (a usage error, or --version)
            return None

    def sweeps(self, args) -> bool:
        """Whether Hydra's parsed command line `args` asks for a sweep: -m (--multirun, --multi, ...), or an
        override hydra.mode=MULTIRUN (+, ++ too, quoted or as the enum's other spellings)."""
        from .config import split_override
        modes = {value.strip().strip("'\"") for key, _, value in map(split_override, args.overrides)
                 if key.strip() == "hydra.mode"}
        return bool(args.multirun or modes & set(self.MULTIRUN_MODES))

    def hydra_output(self, args) -> str | None:
        """The override of Hydra's parsed command line `args` that would turn on what HYDRA_OUTPUT keeps off (or move
        Hydra's directory), or None."""
        from .config import split_override
        for arg in args.overrides:
            key, _, value = split_override(arg)
            kept = self.HYDRA_OUTPUT.get(key.strip())
            if kept is not None and value.strip().strip("'\"").lower() not in kept:
                return arg
        return None

    def output_off(self, args) -> list:
        """`argv` with HYDRA_OUTPUT's settings that keep Hydra's output off, each the command line does not give,
        beside its overrides (Hydra's parser takes them in one run): a primary config without conf/config.yaml's
        (a run's recorded .hydra/config.yaml, a user's own) had Hydra's defaults, outputs/<date>/<time>/ with a
        .hydra copy and a log, written by every rank."""
        from .config import split_override
        given = {split_override(a)[0].strip() for a in args.overrides}
        off = [f"{key}={kept[0]}" for key, kept in self.HYDRA_OUTPUT.items() if key not in given]
        n = len(args.overrides)
        at = next((i for i in range(len(self.argv)) if self.argv[i:i + n] == args.overrides), 0) if n else 0
        return self.argv[:at] + off + self.argv[at:]             # (first where none: --info takes an optional value)

    def shows(self, args) -> bool:
        """Whether Hydra's parsed command line `args` only shows something (--help, --hydra-help, --cfg, --info,
        --shell-completion): printed once per job, by rank 0."""
        return bool(args.help or args.hydra_help or args.cfg or args.info or args.shell_completion)

    def error(self) -> str:
        """What Hydra printed as it refused the command line (held), as one line (explain)."""
        lines = [line.strip() for line in self.held.getvalue().splitlines() if line.strip() not in ("", self.HINT)]
        if any(line.startswith(self.TRACEBACK) for line in lines):
            return self.explain(lines[-1], crashed=True)
        return self.explain(" ".join(lines))

    def explain(self, text: str, crashed: bool = False) -> str:
        """Hydra's report `text` (its lines joined; `crashed`: the exception ending a traceback of its own frames,
        which say nothing to a user) as one line: what refusal() finds in the command line; an unknown key as
        config.unknown_key says it (Hydra's advice, `+key=`, would only be refused next: no such key is read); a
        name a group has no file for, with the names it has (missing_option); else its text, without OmegaConf's
        trailer and Hydra's search path."""
        from .config import config_keys, unknown_key
        refused = self.refusal()
        if refused:
            return refused
        if crashed:
            return f"Hydra could not start with this command line: {text}"
        usage = re.search(r"^usage: .*?: error: (.*)$", text)      # (its parser's: the fault after the synopsis)
        if usage:
            together = ": give the overrides together, after the flags (train.py --cfg job tp=2 steps=5)" \
                if usage.group(1).startswith("unrecognized arguments:") else ""
            return f"{usage.group(1)}{together} (--hydra-help lists the options)"
        key = re.search(r"Could not override '([^']+)'", text)
        if key and " not in " in text and key.group(1) in config_keys(self.schema):
            return (f"{key.group(1)}: the composed config has no such key to override (its primary config leaves it "
                    f"out, or ~{key.group(1)} removed it): set it with +{key.group(1)}=VALUE")
        if key and " not in " in text:
            return str(unknown_key(key.group(1), self.schema))
        return missing_option(text, self.argv) or text.split(" full_key:")[0].split(" Config search path:")[0] \
            or "the configuration could not be composed"

    def refusal(self) -> str | None:
        """What Hydra refuses in the command line, or fails on inside itself, said in one line: a config group
        given what cannot be the name of a config file (model=[1,2], model={a:1}, model=1, model=true, model=),
        which Hydra does not check (nor does it take a number as a name), with the group's names in conf/; a
        config group of another command's config given to this one (cluster=, cluster.gpus=: tools/plan.py's, to
        train.py), with whose it is and this command's groups (unless --config-name chose another config). None
        where neither is."""
        from .config import split_override
        chosen = self.option("--config-name", "-cn")
        own = self.groups(self.config_name) if chosen in (None, self.config_name, f"{self.config_name}.yaml") else None
        for arg in self.argv:
            key, equals, value = split_override(arg)
            value = value.strip()
            group = key.split(".")[0]
            if not equals or not group or not os.path.isdir(os.path.join(self.conf, group)):
                continue
            if own is not None and group not in own:
                users = [f"conf/{n}" for n in sorted(os.listdir(self.conf))
                         if n.endswith(".yaml") and group in self.groups(n[:-len(".yaml")])]
                return (f"{arg}: {group} is a config group of {' and '.join(users) or 'no command'}, not of this "
                        f"command (conf/{self.config_name}.yaml), whose groups are {', '.join(sorted(own))}")
            names = sorted(n[:-len(".yaml")] for n in os.listdir(os.path.join(self.conf, group)) if n.endswith(".yaml"))
            if key == group and value not in names and (not re.fullmatch(r"[\w.\-/]+", value) or _is_number(value)
                                                        or value.lower() in ("true", "false", "null")):
                return f"{arg}: {group} is a config group, which takes one name ({', '.join(names)})"
        return None

    def option(self, *names: str) -> str | None:
        """The value of Hydra's own option `names` (--config-name, -cn) in the command line: `--name value` or
        `--name=value`; None where it is not given."""
        for i, arg in enumerate(self.argv):
            for name in names:
                if arg == name and i + 1 < len(self.argv):
                    return self.argv[i + 1]
                if arg.startswith(f"{name}="):
                    return arg[len(name) + 1:]
        return None

    def groups(self, config_name: str) -> set:
        """The config groups that conf/<config_name>.yaml's defaults list chooses from (none where it has no
        such list, or cannot be read)."""
        from omegaconf import OmegaConf
        try:
            loaded = OmegaConf.to_container(OmegaConf.load(os.path.join(self.conf, f"{config_name}.yaml")))
        except Exception:    # noqa: BLE001 - a user's file that is no config: it chooses no group
            return set()
        defaults = loaded.get("defaults") if isinstance(loaded, dict) else None
        return {key for entry in defaults or () if isinstance(entry, dict) for key in entry
                if os.path.isdir(os.path.join(self.conf, str(key)))}

    def run(self, main) -> None:
        """main() (the @hydra.main function) on this process's command line: a sweep refused where the command
        takes none; what only shows something printed by rank 0 alone; whatever Hydra raises before the entry
        point runs (its report held, or an exception of its own: --resolve without --cfg) as one line, exit 2."""
        self.argv = sys.argv[1:]
        args = self.hydra_args()
        if args is not None and not self.multirun and self.sweeps(args):
            fail(self.MULTIRUN, code=2)
        output = self.hydra_output(args) if args is not None else None
        if output is not None:
            fail(f"{output}: {self.OUTPUT}", code=2)
        if args is not None:
            sys.argv[1:] = self.output_off(args)
        try:
            rank = launch_env()[0]
        except ConfigError:                    # (said once training starts; nothing is shown twice by it)
            rank = 0
        if args is not None and self.shows(args) and rank != 0:
            sys.stdout = open(os.devnull, "w")
        self.real, self.held = sys.stderr, io.StringIO()
        sys.stderr = self.held
        try:
            with hydra_parser_allowed():       # (main() builds Hydra's parser first)
                main()
        except SystemExit as e:                # Hydra refused the command line (its message is held)
            if e.code not in (0, None) and sys.stderr is self.held:
                self.composed(replay=False)
                fail(self.error(), code=2)
            raise
        except Exception as e:     # noqa: BLE001 - raised by Hydra before the entry point ran: the command line's
            if sys.stderr is not self.held:
                raise
            self.composed(replay=False)
            fail(self.explain(first_line(e)), code=2)
        finally:
            self.composed()
