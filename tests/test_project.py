"""Project-level guarantees: the library never imports Dagster; the code location loads light and validates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return result.stdout.strip()


def test_the_library_never_imports_dagster():
    modules = [
        p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        for p in (ROOT / "speculators").rglob("*.py")
        if p.name != "__init__.py"
    ]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(any(m.startswith('dagster') for m in sys.modules))"
    )
    assert run_python(code) == "False"


def test_code_location_loads_without_torch():
    code = "import sys, speculators_assets; print(type(speculators_assets.defs).__name__, 'torch' in sys.modules)"
    assert run_python(code) == "Definitions False"


def test_dagster_definitions_validate():
    dagster = Path(sys.executable).with_name("dagster")
    result = subprocess.run(
        [str(dagster), "definitions", "validate", "-w", "workspace.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Validation successful" in result.stdout + result.stderr


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("speculators")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    for command in ("validate", "convert", "verifier", "init", "tiny-verifier"):
        assert command in result.stdout
