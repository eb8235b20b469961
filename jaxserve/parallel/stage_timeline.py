"""When each pipeline stage of each step finished on its devices: the evidence that the
stages of different steps overlap (pipeline microbatches).

    timeline = StageTimeline.attach(runner)     # ModelRunner.stage_observer
    ... generate ...
    timeline.stop(); print(timeline.format())

    step  stage  done (ms)
      7     0      812.4
      8     0      861.0     <- step 8's stage 0 finished before step 7's stage 1:
      7     1      874.9        the two steps were in the pipeline together

A thread polls `is_ready()` on every stage's output (JAX offers no completion callback);
meant for tests and tools, not for serving. Those times depend on the machine's load; the
host's order of events does not: `dispatched_ahead()` lists the steps whose successor was
dispatched before the host read their tokens (without which no two steps can share the
pipeline).
"""

from __future__ import annotations

import threading
import time
from typing import Any


class StageTimeline:
    def __init__(self, poll_s: float = 0.0005) -> None:
        self.done: dict[tuple[int, int], float] = {}  # (step, stage) -> seconds since start
        self._pending: list[tuple[int, int, Any]] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._events: list[tuple[str, int]] = []  # ("dispatch" | "read", step ordinal)
        self._count = {"dispatch": 0, "read": 0}
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @classmethod
    def attach(cls, runner: Any) -> StageTimeline:
        """Watch every stage `runner` (a ModelRunner) dispatches from now on."""
        timeline = cls()
        runner.stage_observer = timeline.observe
        read = runner.read_output  # a step's first read of its tokens (steps read in order)

        def reading(*args: Any, **kwargs: Any) -> Any:
            timeline._record("read")
            return read(*args, **kwargs)

        runner.read_output = reading
        return timeline

    def observe(self, step: int, stage: int, output: Any) -> None:
        with self._lock:
            self._pending.append((step, stage, output))
        if stage == 0:
            self._record("dispatch")

    def _record(self, kind: str) -> None:
        with self._lock:
            self._count[kind] += 1
            self._events.append((kind, self._count[kind]))

    def dispatched_ahead(self) -> list[int]:
        """Step ordinals k whose successor k + 1 was dispatched before step k's tokens were
        read: the host did not serialise them (independent of timing)."""
        at = {e: i for i, e in enumerate(self._events)}
        return [k for (kind, k) in self._events if kind == "read"
                and ("dispatch", k + 1) in at and at[("dispatch", k + 1)] < at[("read", k)]]

    def _poll(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending = self._pending
                self._pending = []
            now = time.perf_counter() - self._t0
            still = []
            for step, stage, out in pending:
                if all(a.is_ready() for a in _arrays(out)):
                    self.done[(step, stage)] = now
                else:
                    still.append((step, stage, out))
            with self._lock:
                self._pending = still + self._pending
            time.sleep(self._poll_s)

    def stop(self) -> None:
        """Wait for every watched stage, then stop polling."""
        while True:
            with self._lock:
                if not self._pending:
                    break
            time.sleep(0.01)
        self._stop.set()
        self._thread.join()

    def overlapped_steps(self) -> list[int]:
        """Steps n whose successor's first stage finished before n's last stage did."""
        last = max(stage for _, stage in self.done)
        return sorted(n for (n, stage) in self.done if stage == last and (n + 1, 0) in self.done
                      and self.done[(n + 1, 0)] < self.done[(n, last)])

    def format(self) -> str:
        rows = sorted(self.done.items(), key=lambda kv: kv[1])
        return "\n".join(["step  stage  done (ms)"] +
                         [f"{n:4d}  {s:5d}  {1e3 * t:9.1f}" for (n, s), t in rows])


def _arrays(tree: Any) -> list[Any]:
    import jax

    return [a for a in jax.tree_util.tree_leaves(tree) if hasattr(a, "is_ready")]
