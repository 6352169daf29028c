"""A live progress line on stderr while planning runs longer than a second.

Planning traces the model (seconds for a large one, cached afterwards) and estimates every
candidate; a spinner with the elapsed time says the launcher is working. It appears only after
`delay` seconds, only on a terminal, and leaves nothing behind (rich `Progress`, transient).
"""
from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

DELAY_S = 1.0


def _maybe_terminal() -> bool:
    """Whether rich could find stderr to be a terminal (Console.is_terminal)."""
    if any(k in os.environ for k in ("FORCE_TERMINAL", "TTY_INTERACTIVE")):
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def working(message: str, console=None, delay: float = DELAY_S) -> Iterator[None]:
    """Show `message` with a spinner and the elapsed time while the block runs, after `delay`.
    Without a console and with stderr not a terminal (nor forced to be one, rich's FORCE_TERMINAL
    and TTY_INTERACTIVE), rich is not imported: it would show nothing."""
    if console is None and not _maybe_terminal():
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=console, transient=True)
    progress.add_task(message, total=None)
    lock = threading.Lock()
    state: dict[str, Optional[bool]] = {"started": False, "done": False}

    def start() -> None:
        with lock:
            if not state["done"]:
                progress.start()
                state["started"] = True

    timer = threading.Timer(delay, start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            state["done"] = True
            timer.cancel()
            if state["started"]:
                progress.stop()
