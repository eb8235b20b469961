"""jaxserve.platforms: the CPU without probing accelerators only where none is attached, set in
JAX's config, never in the process environment (issue 44: `import jaxserve` changes nothing)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax

import jaxserve.platforms as platforms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import os
before = dict(os.environ)
import jaxserve, jaxserve.serve, jaxserve.api_server.server, jaxserve.engine.resolve
assert dict(os.environ) == before, "import changed the environment"
import jax, jaxserve.platforms as platforms
platforms.accelerator_attached = lambda: False  # as on a laptop, wherever this test runs
platforms.select_jax_platforms()
assert dict(os.environ) == before, "select_jax_platforms changed the environment"
print(jax.config.jax_platforms, jax.devices()[0].platform)
"""


def test_no_accelerator_means_the_cpu_and_the_environment_is_untouched() -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["cpu", "cpu"]


def test_an_accelerator_or_the_users_choice_is_left_to_jax(monkeypatch) -> None:
    updates: list[tuple] = []
    monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platforms, "accelerator_attached", lambda: True)
    platforms.select_jax_platforms()
    assert updates == []
    platforms.select_jax_platforms(cpu_only=True)  # the preflight: compile-only devices
    assert updates == [("jax_platforms", "cpu")]
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.setattr(platforms, "accelerator_attached", lambda: False)
    platforms.select_jax_platforms(cpu_only=True)
    assert updates == [("jax_platforms", "cpu")]
