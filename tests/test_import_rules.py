"""The dependency rules of docs/architecture.md, checked on the source.

- The engine core, the API server, the engine's host side (messages, core clients, output
  processor), a model's files and tokenizer, and the shared host-side modules (configs,
  sampling params, user-facing outputs and traces) never import JAX, jaxlib or Flax.
- The engine core never imports the worker or the models: it reaches them only
  through SchedulerOutput / ModelRunnerOutput.
- The API server reaches the engine core through jaxserve/engine (clients, input processor);
  of the engine core it reads only the records a step sends back (outputs, stats).
- kernels_pallas never imports jaxserve.

The AST check sees direct imports (also relative ones, also under
TYPE_CHECKING); the subprocess check catches transitive ones.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOST_SIDE_ENGINE = ["__init__", "messages", "protocol", "core_client", "dp_client", "output_processor",
                    "processor", "arg_utils", "front_end"]
JAX_FREE = [
    "jaxserve/engine_core",
    "jaxserve/api_server",
    "jaxserve/metrics",
    *(f"jaxserve/engine/{m}.py" for m in HOST_SIDE_ENGINE),
    "jaxserve/models/model_files.py",
    "jaxserve/models/tokenizer.py",
    "jaxserve/config.py",
    "jaxserve/weight_format.py",
    "jaxserve/sampling_params.py",
    "jaxserve/pooling_params.py",
    "jaxserve/outputs.py",
    "jaxserve/request_trace.py",
    "jaxserve/serve.py",
]
JAX_PACKAGES = {"jax", "jaxlib", "flax"}
ENGINE_CORE_FORBIDDEN = ("jaxserve.worker", "jaxserve.models")
# Importing these must not pull JAX in transitively.
JAX_FREE_IMPORTS = [
    "jaxserve.engine_core",
    "jaxserve.api_server.server",
    "jaxserve.metrics.prometheus",
    "jaxserve.metrics.trace_store",
    *(f"jaxserve.engine.{m}" for m in HOST_SIDE_ENGINE[1:]),
    "jaxserve.models.tokenizer",
    "jaxserve.config",
    "jaxserve.weight_format",
    "jaxserve.sampling_params",
    "jaxserve.pooling_params",
    "jaxserve.outputs",
    "jaxserve.serve",
]


def python_files(rel: str) -> list[Path]:
    path = ROOT / rel
    if path.is_file():
        return [path]
    return sorted(path.rglob("*.py")) if path.is_dir() else []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for alias in node.names:  # `from jaxserve import worker`
                yield node.lineno, f"{mod}.{alias.name}"
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def violations(rel_paths: list[str], forbidden) -> list[str]:
    out = []
    for rel in rel_paths:
        for path in python_files(rel):
            for line, mod in imported_modules(path):
                if forbidden(mod):
                    out.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return out


def test_host_side_modules_do_not_import_jax():
    assert violations(JAX_FREE, lambda m: m.split(".")[0] in JAX_PACKAGES) == []


def test_engine_core_does_not_import_worker_or_models():
    def forbidden(mod: str) -> bool:
        return any(mod == f or mod.startswith(f + ".") for f in ENGINE_CORE_FORBIDDEN)

    assert violations(["jaxserve/engine_core"], forbidden) == []


API_SERVER_MAY_READ = ("jaxserve.engine_core.core_outputs", "jaxserve.engine_core.stats")


def test_api_server_reads_only_the_engine_cores_records():
    def forbidden(mod: str) -> bool:
        return mod.startswith("jaxserve.engine_core") and not any(
            mod == m or mod.startswith(m + ".") for m in API_SERVER_MAY_READ)

    assert violations(["jaxserve/api_server"], forbidden) == []


def test_nothing_below_the_api_server_imports_it():
    # The request path runs one way (docs/architecture.md): the engine client records into
    # jaxserve/metrics, which the API server serves.
    below = ["jaxserve/engine", "jaxserve/engine_core", "jaxserve/worker", "jaxserve/models",
             "jaxserve/parallel", "jaxserve/metrics"]
    assert violations(below, lambda m: m.startswith("jaxserve.api_server")) == []


def test_kernels_do_not_import_jaxserve():
    assert violations(["kernels_pallas"], lambda m: m.split(".")[0] == "jaxserve") == []


def test_the_checker_sees_relative_and_dynamic_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "jaxserve" / "engine_core"
    pkg.mkdir(parents=True)
    bad = pkg / "bad.py"
    bad.write_text(
        "from ..worker import model_runner\n"
        "from jaxserve import models\n"
        "import importlib\n"
        "importlib.import_module('jax.numpy')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    mods = [m for _, m in imported_modules(bad)]
    assert "jaxserve.worker" in mods and "jaxserve.models" in mods and "jax.numpy" in mods


@pytest.mark.parametrize("module", JAX_FREE_IMPORTS)
def test_importing_host_side_modules_does_not_load_jax(module):
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'jax', 'jaxlib', 'flax'})\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_every_environment_variable_is_documented():
    """Settings travel as flags and config fields: the few variables read of our own are named
    in README.md's "Environment variables" table."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    quoted = re.compile(r"""["'](JAXSERVE_[A-Z0-9_]+|KERNELS_PALLAS_[A-Z0-9_]+)["']""")
    names: dict[str, str] = {}
    for folder in ("jaxserve", "kernels_pallas", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".cc", ".h"):
                for name in quoted.findall(path.read_text()):
                    names.setdefault(name, str(path.relative_to(ROOT)))
    assert "JAXSERVE_API_KEY" in names  # the scan sees them
    missing = {n: where for n, where in names.items() if f"`{n}`" not in section}
    assert not missing, f"undocumented environment variables (README.md): {missing}"
