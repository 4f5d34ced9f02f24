"""Process plumbing shared by every verb: stop signals, and turning user errors into one line."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import sys
from typing import Awaitable, Callable, Optional

from ravnest_swarm.errors import UserError, print_error


def install_stop_signals(on_stop: Optional[Callable[[], None]] = None,
                         again: Optional[asyncio.Event] = None) -> asyncio.Event:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal) set the returned event, so the caller can leave cleanly and
    exit 0 (stopping its p2pd, which no signal from a terminal reaches: ``net.node.spare_p2pd_from_ctrl_c``).

    :param on_stop: called at the first signal, at once (to say "stopping..." before any slow cleanup)
    :param again: set by a second signal, to cut a long cleanup (a hand-over) short
    """
    stop = asyncio.Event()

    def on_signal():
        if stop.is_set():
            if again is not None:
                again.set()
            return
        stop.set()
        if on_stop is not None:
            on_stop()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    return stop


class OutputOutlivingItsReader:
    """``sys.stdout`` or ``sys.stderr`` for a process whose reader may go first: Ctrl-C on ``join ... | tee log``
    ends ``tee`` too, and the peer's next line ("stopping...") raised BrokenPipeError in the middle of its
    graceful leave, which then neither handed its layers over nor published ``leaving``. The first write to a
    closed pipe points the descriptor at /dev/null, so every later line, ours or a library's, is dropped and the
    leave goes on. So does a write to a closed terminal (EIO), whose SIGHUP started that leave."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._drop_from_now_on(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._drop_from_now_on(e)

    def _drop_from_now_on(self, error: OSError) -> None:
        if not isinstance(error, BrokenPipeError) and error.errno != errno.EIO:
            raise error
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_a_closed_terminal() -> None:
    """Wrap stdout and stderr in :class:`OutputOutlivingItsReader` (before logging or rich take them)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, OutputOutlivingItsReader):
            setattr(sys, name, OutputOutlivingItsReader(stream))


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(verbose: bool = False) -> None:
    """Our own log lines at INFO; hivemind's chatter only at WARNING unless ``--verbose``."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    if not verbose:
        logging.getLogger("hivemind").setLevel(logging.ERROR)


def log_to_file(path: str) -> None:
    """Every log line from now on (ours, and hivemind's, which has a handler of its own) goes to ``path``,
    appended, instead of the terminal (``--log-file``); a path that cannot be opened is a one-line error."""
    from hivemind.utils.logging import use_hivemind_log_handler

    try:
        handler = logging.FileHandler(path)
    except OSError as e:
        raise UserError(f"--log-file {path}: {e.strerror}")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for screen in list(root.handlers):
        root.removeHandler(screen)
    root.addHandler(handler)
    use_hivemind_log_handler("nowhere")  # hivemind's records propagate to the root logger: to the file


def run_async(coroutine: Awaitable) -> int:
    """Run a verb's coroutine; a :class:`UserError` becomes ``error: ...`` on stderr and its exit code.

    SIGTERM and SIGHUP cancel it as Ctrl-C does (its ``finally`` blocks stop what it started; exit code 130),
    unless the verb handles them itself (:func:`install_stop_signals`). Python's default would end the process
    at once and orphan every process and namespace it started, p2pd included.
    """
    return _exit_code(lambda: asyncio.run(_cancelled_by_sigterm(coroutine)))


async def _cancelled_by_sigterm(coroutine: Awaitable):
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, asyncio.current_task().cancel)
    loop.set_exception_handler(_ignore_stopped_handlers)
    return await coroutine


def _ignore_stopped_handlers(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """Report what asyncio reports, except a P2P stream handler cancelled on purpose, or gone with its daemon.

    hivemind cancels a P2P handler's task when the handler is removed (a stage or the averager stopping);
    Python 3.11's stream callback then calls ``exception()`` on the cancelled task and asyncio logs that
    CancelledError as a 14-line ERROR traceback, at every stop. A stream for a handler just removed fails
    with hivemind's ``DispatchFailure`` (the sender sees it closed and re-resolves), and a p2pd that died
    resets the control connection under hivemind's fire-and-forget writes. Nothing to act on: nothing said.
    hivemind's p2pd reader sets the result of a call that already timed out (``InvalidStateError``; seen with a
    hundred peers on one busy backbone): the caller has had its timeout, so that too is said only in debug.
    Anything else is one warning line, its traceback only with ``RAVNEST_DEBUG=1``: no traceback reaches a
    volunteer's terminal.
    """
    # looked up, not imported: a verb without a P2P node need not load hivemind, and asyncio may call this
    # while Python shuts down, when nothing can be imported any more
    bindings = sys.modules.get("hivemind.p2p.p2p_daemon_bindings.utils")
    dispatch_failure = getattr(bindings, "DispatchFailure", ConnectionResetError)
    exception = context.get("exception")
    if isinstance(exception, asyncio.CancelledError):
        return
    logger = logging.getLogger(__name__)
    if isinstance(exception, (dispatch_failure, ConnectionResetError, asyncio.InvalidStateError)):
        logger.debug(f"{context.get('message')}: {exception!r}")
        return
    if os.environ.get("RAVNEST_DEBUG"):
        loop.default_exception_handler(context)
        return
    said = repr(exception) if exception is not None else _waiting_where(context.get("task"))
    logger.warning(f"{context.get('message')}: {said} (set RAVNEST_DEBUG=1 for the traceback)")


def _waiting_where(task: Optional[asyncio.Task]) -> str:
    """Which coroutine a task ran (its function and where that is defined) and, where its frames still exist, where
    its innermost await waited: asyncio's "Task was destroyed but it is pending!" names no exception (a
    walkthrough's line said only ``None``), and a collected coroutine may be closed before its task says so."""
    if task is None:
        return "None"
    coroutine = inner = task.get_coro()
    code = getattr(coroutine, "cr_code", None)
    said = getattr(coroutine, "__qualname__", type(coroutine).__name__)
    if code is not None:
        said += f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    while getattr(inner, "cr_await", None) is not None and hasattr(inner.cr_await, "cr_frame"):
        inner = inner.cr_await
    frame = getattr(inner, "cr_frame", None)
    if frame is not None:
        said += f" waiting at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    return said


def run_blocking(verb: Callable[[], Optional[int]]) -> int:
    """Run a verb that blocks instead of awaiting (the benches that start processes and wait for them).

    Not under ``asyncio.run``, whose Ctrl-C only cancels the main task at its next await: a verb that never
    awaits would ignore Ctrl-C until done. Here Ctrl-C, SIGTERM and SIGHUP interrupt it wherever it waits, its
    cleanup (``finally``, context managers: the processes it started, the lab's namespaces) runs, and the
    exit code is 130. Python's default SIGTERM would end the process at once and orphan all of that.
    """
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _exit_code(verb)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupt(signum, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the cleanup short
    raise KeyboardInterrupt


def _exit_code(verb: Callable[[], Optional[int]]) -> int:
    try:
        result = verb()
    except UserError as e:
        print_error(str(e))
        return e.exit_code
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    return int(result or 0)


def unexpected_error_as_one_line(error: Exception) -> int:
    """A bug or an environment problem nobody foresaw: still one line on stderr, exit code 1; with
    ``RAVNEST_DEBUG=1`` the traceback instead (re-raised)."""
    if os.environ.get("RAVNEST_DEBUG"):
        raise error
    print_error(f"unexpected {type(error).__name__}: {error} (set RAVNEST_DEBUG=1 for the traceback)")
    return 1


async def until_set(awaitable, event: asyncio.Event, timeout: Optional[float] = None) -> None:
    """Await ``awaitable`` until it is done, ``event`` is set (then cancel it) or ``timeout`` passes."""
    task, waiter = asyncio.ensure_future(awaitable), asyncio.create_task(event.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()
