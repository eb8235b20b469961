"""Programs compiled so far out of how many, while start-up or the preflight compiles them.

vLLM shows a tqdm bar over its CUDA graph capture sizes (on the first rank only); jaxserve's
counterpart of that phase is compiling its programs (`ModelRunner.warm_up`,
`programs.compile_programs`). Where the output goes decides the form:

    a terminal   a tqdm bar whose clock keeps moving during a long compile (one program can
                 take minutes on a TPU), console logging redirected above it
    otherwise    a log line every LOG_INTERVAL_S (a log file, a pipe, a service's journal):
                 "Compiling programs: 12/40 (forward[T=16]) 23 s"

No flag: vLLM has none for this either; the stream's isatty() decides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0  # a log line this often: readable logs over a preflight's minutes
TTY_REFRESH_S = 1.0  # the bar's elapsed time, refreshed while one program compiles
SHOWN_NAMES = 2  # programs compiling now named on a line; the rest counted
FALLBACK_COLUMNS = 100  # the bar's width on a terminal that reports none
FALLBACK_LINES = 24


class CompileProgress:
    """Counts programs as they finish; a context manager around the compiles.

    Thread-safe: `compile_programs` compiles in threads. Inside `compiling(name)` a program is
    named as being compiled now; `done(ok)` counts one finished (failed: `ok` False)."""

    def __init__(self, total: int, desc: str = "Compiling programs", *, show: bool = True,
                 stream: TextIO | None = None, log_interval_s: float = LOG_INTERVAL_S) -> None:
        """`show` False: count only, print nothing (a rank other than the first, as vLLM).
        `stream`: where the bar goes and whose isatty() picks bar or log lines (stderr)."""
        self.total = total
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.show = show and total > 0
        self.tty = self.show and _isatty(self.stream)
        self.interval_s = TTY_REFRESH_S if self.tty else log_interval_s
        self.num_done = 0
        self.num_failed = 0
        self._now: dict[str, None] = {}  # compiling now, in the order they began (an ordered set)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._bar: tqdm | None = None
        self._thread: threading.Thread | None = None
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> CompileProgress:
        self._t0 = time.perf_counter()
        if not self.show:
            return self
        if self.tty:
            # Log records (this process's, from any thread) print above the bar, not through it.
            self._exit.enter_context(logging_redirect_tqdm())
            # tqdm hides its bar on a terminal that reports no size (a pseudo-terminal never
            # sized, as `script` or some CI runners make): a fixed size there.
            columns, lines = _terminal_size(self.stream)
            sized = columns > 0 and lines > 0
            self._bar = tqdm(total=self.total, desc=self.desc, unit="program", file=self.stream,
                             dynamic_ncols=sized, ncols=None if sized else columns or FALLBACK_COLUMNS,
                             nrows=None if sized else FALLBACK_LINES, leave=True)
        else:
            self._log()
        self._thread = threading.Thread(target=self._tick, name="compile-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.set_postfix_str(self._postfix(), refresh=False)
                self._bar.close()
            elif self.show:
                self._log(final=True)
        self._exit.close()

    @contextlib.contextmanager
    def compiling(self, name: str) -> Iterator[None]:
        """`name` is being traced, lowered or compiled inside the block."""
        with self._lock:
            self._now[name] = None
            if self._bar is not None:
                self._bar.set_postfix_str(self._postfix(), refresh=True)
        try:
            yield
        finally:
            with self._lock:
                self._now.pop(name, None)

    def done(self, ok: bool = True) -> None:
        """One more program finished (compiled, or `ok` False: failed)."""
        with self._lock:
            self.num_done += 1
            self.num_failed += not ok
            if self._bar is not None:
                # The finished program stays named until the next begins: a steady bar.
                if self._now or not ok:
                    self._bar.set_postfix_str(self._postfix(), refresh=False)
                self._bar.update()

    def line(self, final: bool = False) -> str:
        """The progress as one log line (the caller holds the lock, or the counts are settled)."""
        elapsed = time.perf_counter() - self._t0
        text = f"{self.desc}: {self.num_done}/{self.total}"
        if self.num_failed:
            text += f", {self.num_failed} failed"
        if final:
            return f"{text} in {elapsed:.1f} s"
        names = self._names()
        return f"{text}{f' ({names})' if names else ''} {elapsed:.0f} s"

    def _names(self) -> str:
        names = list(self._now)
        more = len(names) - SHOWN_NAMES
        return ", ".join(names[:SHOWN_NAMES]) + (f" +{more} more" if more > 0 else "")

    def _postfix(self) -> str:
        """The bar's tail: what compiles now, and how many failed."""
        failed = f"{self.num_failed} failed" if self.num_failed else ""
        return ", ".join(t for t in (self._names(), failed) if t)

    def _log(self, final: bool = False) -> None:
        logger.info("%s", self.line(final))

    def _tick(self) -> None:
        """Every interval: redraw the bar (its clock), or log a line."""
        while not self._stop.wait(self.interval_s):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()
                else:
                    self._log()


def _terminal_size(stream: TextIO) -> tuple[int, int]:
    """(columns, lines) of the terminal; 0 where it reports none."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return 0, 0
    return size.columns, size.lines


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False
