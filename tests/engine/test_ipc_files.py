"""The API server owns the engine core's ipc:// socket files: whatever way it ends, they go.
Real ZeroMQ sockets and real processes; no JAX (the end-to-end exits are in
tests/api_server/test_engine_death.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import time

from jaxserve.engine.core_client import AsyncMPClient
from jaxserve.engine.messages import new_ipc_addresses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _files(*addresses: str) -> list[str]:
    return [a for a in addresses if os.path.exists(a.removeprefix("ipc://"))]


def test_shutdown_removes_the_files_when_the_engine_process_no_longer_listens() -> None:
    # The path a loaded machine took: after its fault the engine process was still tearing
    # down, alive but disconnected, when the grace period ended; the SHUTDOWN send raised
    # zmq.Again and the files stayed. Here the process never connects at all.
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    addresses = new_ipc_addresses()
    client = AsyncMPClient(None, proc, *addresses)
    assert len(_files(*addresses)) == 2

    async def twice() -> None:
        await client.shutdown()
        await client.shutdown()  # idempotent

    asyncio.run(twice())
    assert not _files(*addresses)
    assert not proc.is_alive()  # waited for, then terminated


def test_files_are_removed_at_exit_when_nothing_shut_the_client_down(tmp_path) -> None:
    # An exception that escapes before any cleanup: the atexit hook removes them.
    code = (
        "import multiprocessing, time\n"
        "from jaxserve.engine.core_client import AsyncMPClient\n"
        "from jaxserve.engine.messages import new_ipc_addresses\n"
        "if __name__ == '__main__':\n"
        "    p = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(60,), daemon=True)\n"
        "    p.start()\n"
        "    client = AsyncMPClient(None, p, *new_ipc_addresses())\n"
        "    print('bound', flush=True)\n"
        "    raise RuntimeError('a bug in the API server')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 1 and "bound" in r.stdout and "a bug in the API server" in r.stderr
    assert not list(tmp_path.glob("jaxserve-*")), list(tmp_path.iterdir())
