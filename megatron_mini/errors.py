"""The failures a run explains in one line (train.py and launch.fail turn them into `error: ...`); no torch
here, so that train.py refuses a bad config before it imports torch."""
import os
import re
import select
import signal
import sys


class ConfigError(Exception):
    """A bad configuration: the message is shown as is, on one rank, and every rank exits 2."""


class RunError(Exception):
    """A failure during a run that every rank knows of (a failed save, say): rank `reporter` prints
    the message and every rank exits 1."""

    def __init__(self, message: str, reporter: int = 0):
        super().__init__(message)
        self.reporter = reporter


class CommError(RuntimeError):
    """A collective or transfer that failed: a peer died, or stalled past the groups' timeout (comm.py
    names the rank, the op and the group)."""


def peer_closed(e: BaseException) -> bool:
    """Whether the failed transfer `e` (gloo's) found its peer's connection closed or reset: that process ended."""
    return re.search(r"connection (closed|reset)", str(e), re.I) is not None


def first_line(e: BaseException) -> str:
    """`Type: the first line of its message`, for a one-line error that quotes an exception."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def run_tool(main) -> None:
    """sys.exit(main()) for a command line whose output a reader may stop reading early (`tools/plan.py ... | head`):
    it then ends as `yes | head` ends `yes`, quietly and with status 128 + SIGPIPE, not with a BrokenPipeError
    traceback (stdout is pointed at /dev/null, so the interpreter's last flush does not raise again). Another broken
    pipe (a worker's, a socket's) is raised as it was."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        if not _reader_gone(sys.stdout):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    sys.exit(code)


def _reader_gone(stream) -> bool:
    """Whether `stream`'s reader is gone: poll reports an error on a pipe's (or FIFO's) writing end whose reading end
    is closed, a hang-up on a socket whose peer has closed it."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):       # (no file descriptor: a test's capture; no poll)
        return False
