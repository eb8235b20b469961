"""Start-up's compile progress (worker/compile_progress.py): programs compiled so far out of
how many, as log lines where stderr is not a terminal and as a tqdm bar where it is."""

from __future__ import annotations

import io
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxserve.worker.compile_progress import CompileProgress
from jaxserve.worker.programs import Program, ProgramKind, compile_programs

LOGGER = "jaxserve.worker.compile_progress"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _programs() -> list[Program]:
    """Two tiny programs and one whose trace fails (its error is its result)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    x = jax.ShapeDtypeStruct((4,), jnp.float32)

    def broken(a: jax.Array) -> jax.Array:
        raise ValueError("does not trace")

    return [Program("double", ProgramKind.FORWARD, jax.jit(lambda a: a * 2), (x,), mesh),
            Program("broken", ProgramKind.FORWARD, jax.jit(broken), (x,), mesh),
            Program("sum", ProgramKind.SAMPLE, jax.jit(jnp.sum), (x,), mesh)]


@pytest.mark.parametrize("threads", [1, 2])
def test_log_lines_count_the_programs(threads: int, caplog: pytest.LogCaptureFixture) -> None:
    programs = _programs()
    caplog.set_level(logging.INFO, logger=LOGGER)
    progress = CompileProgress(len(programs), "Compiling programs", stream=io.StringIO(),
                               log_interval_s=0.001)
    results = compile_programs(programs, threads=threads, progress=progress)
    assert [isinstance(r, BaseException) for r in results] == [False, True, False]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines[0] == "Compiling programs: 0/3 0 s"
    assert re.fullmatch(r"Compiling programs: 3/3, 1 failed in \d+\.\d s", lines[-1]), lines[-1]
    counts = [int(m.group(1)) for m in (re.match(r"Compiling programs: (\d)/3", x) for x in lines)
              if m is not None]
    assert len(counts) == len(lines) and counts == sorted(counts)  # every line counts, in order
    assert not progress.stream.getvalue()  # no bar where the stream is not a terminal


def test_a_terminal_gets_a_bar_and_no_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    terminal = Terminal()
    with CompileProgress(2, "Compiling programs", stream=terminal) as progress:
        for name in ("forward[T=16]", "sample[R=8, greedy]"):
            with progress.compiling(name):
                pass
            progress.done()
    assert "Compiling programs: 100%" in terminal.getvalue()
    assert "2/2" in terminal.getvalue()
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_hidden_progress_counts_silently(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    stream = Terminal()
    with CompileProgress(1, show=False, stream=stream) as progress:
        progress.done()
    assert progress.num_done == 1 and not stream.getvalue() and not caplog.records
