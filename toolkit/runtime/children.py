"""The processes a command starts, and their end: each in a session of its own, ended with everything below it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading

from toolkit.errors import interrupted

# seconds between SIGTERM and SIGKILL when a command ends its children: long enough for a launcher to pass SIGTERM
# on and for ranks to exit, short enough that Ctrl-C still feels like it stops the command
GRACE_S = 10.0


def _tree(pid: int) -> list:
    """The process `pid` and every process below it, as psutil sees them now (the running ones)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal(processes: list, leader: int, sig: int) -> None:
    """`sig` to each process, to the group `leader` started (start_new_session), and to the group of each one that
    leads its own (torchrun starts every worker in a session of its own): a process reparented when its parent
    died is still reached through its group."""
    import psutil

    groups = {leader} | {p.pid for p in processes if _leads_group(p)}
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(sig)


def _leads_group(process) -> bool:
    try:
        return os.getpgid(process.pid) == process.pid
    except OSError:
        return False


@contextlib.contextmanager
def _sigint_handled_by(handler):
    """SIGINT goes to `handler` inside the block and to the handler before it (yielded) once the block ends. Only the
    main thread may set handlers: elsewhere nothing is swapped and None is yielded."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield previous
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _no_second_interrupt():
    """A second Ctrl-C while children are being ended would leave them half-ended: held off until they are."""
    with _sigint_handled_by(signal.SIG_IGN):
        yield


@contextlib.contextmanager
def _interrupt_held():
    """A Ctrl-C (SIGINT) inside the block takes effect when it ends, through the handler that was there before. The
    handler is swapped, not the signal mask blocked: a blocked SIGINT would be inherited by the processes started
    inside (an exec resets handlers, not the mask). An ignored SIGINT stays ignored, and so inherited as before; one
    whose handler Python did not set is left alone."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield
        return
    caught: list[tuple] = []
    previous = None
    try:
        with _sigint_handled_by(lambda signum, frame: caught.append((signum, frame))) as previous:
            yield
    finally:  # the handler before is back: the interrupt the block held goes to it now
        if caught and callable(previous):
            previous(*caught[0])  # Python's default_int_handler raises KeyboardInterrupt here
        elif caught and previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


def end_tree(process: subprocess.Popen, grace_s: float = GRACE_S) -> int:
    """End `process` (started in a session of its own) and every process below it: SIGTERM, then SIGKILL to those
    left after `grace_s` (0: SIGKILL at once, a crash); reaped. The number of processes that were still running."""
    import psutil

    with _no_second_interrupt():
        tree = [p for p in _tree(process.pid) if _running(p)]
        running = len(tree)
        if grace_s > 0:
            _signal(tree, process.pid, signal.SIGTERM)
            _, tree = psutil.wait_procs(tree, timeout=grace_s)
        _signal(tree, process.pid, signal.SIGKILL)  # SIGKILL also ends a stopped process
        process.wait()
        psutil.wait_procs(tree, timeout=30)
        return running


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Children:
    """The processes one step of a command starts (`what`: "the reference run's training"), each in a session of
    its own so that the terminal's Ctrl-C reaches only the command. However the block ends (done, an error, Ctrl-C),
    each child still running is ended with everything below it (end_tree); on Ctrl-C the interrupt carries what was
    ended to the command's one line."""

    def __init__(self, what: str, grace_s: float = GRACE_S):
        self.what, self.grace_s = what, grace_s
        self.processes: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **popen) -> subprocess.Popen:
        """The child started and tracked. A Ctrl-C while it starts is raised once it is tracked, so that the block's
        end ends it: raised inside Popen (which waits for the exec) or before the append, it left a child running in
        a session of its own that nothing would end."""
        with _interrupt_held():
            process = subprocess.Popen(cmd, start_new_session=True, **popen)
            self.processes.append(process)
        return process

    def __enter__(self) -> Children:
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        with _no_second_interrupt():
            running = [p for p in self.processes if p.poll() is None]
            ended = sum(end_tree(p, self.grace_s) for p in self.processes)
        if isinstance(exc, KeyboardInterrupt):
            count = f"{ended} process{'es' if ended != 1 else ''}" if running else "already finished"
            raise interrupted(exc, f"ended {self.what} ({count})") from None
        return False
