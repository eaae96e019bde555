"""megatron_mini: a minimal Megatron-style GPT pre-training framework (README.md).

It runs on Linux and macOS: the run and data directories are locked with fcntl.flock, a CPU rank's peak memory is
read with resource.getrusage, and the ranks take POSIX signals. A Python without those modules (native Windows) is
refused here, as the package is imported, in one line: WSL runs it."""
try:
    import fcntl  # noqa: F401
    import resource  # noqa: F401
except ModuleNotFoundError as e:
    raise SystemExit(f"error: megatron_mini runs on Linux or macOS (on Windows: in WSL); this Python has no {e.name} "
                     f"module (POSIX only), which it needs.") from None
