"""`python -m jaxserve.serve` with a worker that raises on its N-th forward (vLLM's fault
injection): `JAXSERVE_TEST_FAIL_AT_STEP=N python -m tests.api_server.faulty_serve ARGS`.
`JAXSERVE_TEST_FAIL_GRAMMAR_AFTER=K`: instead, every grammar matcher fails once its request
has K tokens (what llguidance does when a grammar outgrows its parser's limits mid-way).
`JAXSERVE_TEST_FAIL_API_SERVER=1`: the API server itself raises while the engine core loads.
`JAXSERVE_TEST_DEAD_GRACE_S=S`: the grace period after an engine's death (so that a test on
a busy machine still sees the 503s before the server exits).

The engine core is a spawned process, which imports this module again as `__mp_main__`
before it runs: that is where the runner is patched, so the API server (which must not
import JAX) is untouched.
"""

from __future__ import annotations

import os
import sys
from typing import Any

FAIL_AT = int(os.environ.get("JAXSERVE_TEST_FAIL_AT_STEP", "0"))
FAIL_GRAMMAR_AFTER = int(os.environ.get("JAXSERVE_TEST_FAIL_GRAMMAR_AFTER", "0"))
FAIL_API_SERVER = os.environ.get("JAXSERVE_TEST_FAIL_API_SERVER") == "1"
DEAD_GRACE_S = os.environ.get("JAXSERVE_TEST_DEAD_GRACE_S")


class InjectedFault(RuntimeError):
    """The failure this module injects."""


def _patch_model_runner() -> None:
    from jaxserve.worker.model_runner import ModelRunner

    original, calls = ModelRunner.execute_model_async, [0]

    def execute_model_async(self: ModelRunner, scheduler_output: Any) -> Any:
        # Both step paths (execute_model too) come through here.
        calls[0] += 1
        if calls[0] == FAIL_AT:
            raise InjectedFault(f"injected fault on forward {FAIL_AT}")
        return original(self, scheduler_output)

    ModelRunner.execute_model_async = execute_model_async


def _patch_grammar_matchers() -> None:
    from jaxserve.engine_core.structured_output import StructuredOutputManager

    original, seen = StructuredOutputManager.accept_tokens, {}

    def accept_tokens(self: StructuredOutputManager, req_id: str, token_ids: list[int]) -> Any:
        if req_id not in self.matchers:  # no grammar: nothing to fail
            return original(self, req_id, token_ids)
        seen[req_id] = seen.get(req_id, 0) + len(token_ids)
        if seen[req_id] >= FAIL_GRAMMAR_AFTER:
            return "structured output failed: injected matcher failure"
        return original(self, req_id, token_ids)

    StructuredOutputManager.accept_tokens = accept_tokens


if __name__ == "__mp_main__" and FAIL_AT:
    _patch_model_runner()
if __name__ == "__mp_main__" and FAIL_GRAMMAR_AFTER:
    _patch_grammar_matchers()


def _patch_api_server() -> None:
    from jaxserve.api_server import server

    if DEAD_GRACE_S is not None:
        server.ENGINE_DEAD_GRACE_S = float(DEAD_GRACE_S)
    if FAIL_API_SERVER:
        async def wait_until_ready(self: Any) -> Any:
            raise InjectedFault("injected API server failure")

        server.AsyncMPClient.wait_until_ready = wait_until_ready


if __name__ == "__main__":
    from jaxserve.serve import main

    _patch_api_server()
    sys.exit(main())
