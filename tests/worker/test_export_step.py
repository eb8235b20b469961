"""scripts/export_step.py: the real runner's step exports device-clean for CUDA and TPU."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import export

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("export_step", ROOT / "scripts" / "export_step.py")
export_step = importlib.util.module_from_spec(_spec)
sys.modules["export_step"] = export_step  # dataclasses look their module up
_spec.loader.exec_module(export_step)


@pytest.mark.parametrize("shapes", ["default", "llama3-8b"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_step_exports_device_clean(platform: str, shapes: str) -> None:
    reports = export_step.export_step(shapes, platform)
    assert {r.name.split("[")[0] for r in reports} == {"forward", "sample", "verify"}
    # Two token buckets; three sampler modes without and with the penalties and processors,
    # plain and verifying drafts (speculative decoding).
    assert len(reports) == 2 + 3 * 2 + 3 * 2
    for r in reports:
        assert r.ok, f"{r.name}: {r.detail}"


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_int8_weights_and_fp8_cache_export_device_clean(platform: str) -> None:
    reports = export_step.export_step("default", platform, quantization="int8", kv_cache_dtype="fp8")
    assert len(reports) == 2 + 3 * 2 + 3 * 2
    for r in reports:
        assert r.ok, f"{r.name}: {r.detail}"


def _exported(fn, *args, donate=()):
    return export.export(jax.jit(fn, donate_argnums=donate), platforms=["cuda"])(*args)


def test_checker_catches_what_it_must() -> None:
    """The checks are not vacuous: a branch, a data-bound loop and a copied cache all fail."""
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    n = jax.ShapeDtypeStruct((), jnp.int32)
    branch = _exported(lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), x)
    assert any("stablehlo.case" in p for p in export_step.check_program(branch, None))
    loop = _exported(lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: c * 2, x), x, n)
    assert any("trip count" in p for p in export_step.check_program(loop, None))
    counted = _exported(lambda x: jax.lax.fori_loop(0, 4, lambda i, c: c * 2, x), x)
    assert export_step.check_program(counted, None) == []
    kept = _exported(lambda c: c + 1, x)  # not donated: the cache would be copied
    assert export_step.check_program(kept, "tensor<8xf32>")
    donated = _exported(lambda c: c + 1, x, donate=(0,))
    assert export_step.check_program(donated, "tensor<8xf32>") == []
