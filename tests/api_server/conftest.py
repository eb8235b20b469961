"""Servers shared by several test modules (each start costs a model load and its compiles)."""

from __future__ import annotations

import pytest

from .server_utils import EAGER, SMALL_ENGINE_ARGS, RemoteServer


@pytest.fixture(scope="session")
def agent_server():
    """The default model behind `--enable-auto-tool-choice --tool-call-parser hermes`: what
    the Responses and Messages tests (the agents' APIs) drive."""
    with RemoteServer([*SMALL_ENGINE_ARGS, *EAGER, "--enable-auto-tool-choice", "--tool-call-parser",
                       "hermes", "--responses-store-size", "4"]) as s:
        yield s
