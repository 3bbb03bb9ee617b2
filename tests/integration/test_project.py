"""Project-level guarantees: the library never imports Dagster; the code location loads light and validates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT_DIR

ROOT = ROOT_DIR


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


def layer_modules() -> list[str]:
    """The modules named by the layers contract in pyproject.toml (`a | b` names two)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [name.strip() for layer in layers for name in layer.split("|")]


def test_every_module_of_the_library_sits_in_a_layer():
    """import-linter checks only the layers it is given: a new top-level module or package of the
    library must be placed in the contract, or its imports would go unchecked."""
    named = set(layer_modules())
    top = {
        "speculators." + (p.stem if p.is_file() else p.name)
        for p in (ROOT / "speculators").iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()
    }
    assert top == named, f"not in a layer: {sorted(top - named)}; not in the library: {sorted(named - top)}"


def test_the_layers_contract_catches_an_upward_import(tmp_path):
    """The contract is live: a copy of the library in which a low layer (models) imports a high one
    (train) breaks it, and the real library keeps it."""
    import shutil

    lint = Path(sys.executable).with_name("lint-imports")
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "speculators", copy / "speculators", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(
        ROOT / "speculators_assets", copy / "speculators_assets", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    weights = copy / "speculators" / "models" / "weights.py"
    weights.write_text(weights.read_text() + "\nfrom speculators.train import trainer  # noqa\n")
    env = {"PYTHONPATH": str(copy), "PATH": str(lint.parent)}
    broken = subprocess.run([str(lint), "--no-cache"], cwd=copy, capture_output=True, text=True, env=env)
    assert broken.returncode != 0 and "speculators.models.weights -> speculators.train.trainer" in broken.stdout
    kept = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert kept.returncode == 0, kept.stdout


def test_the_readme_links_resolve():
    """Every relative link of README.md names a file (and, for an anchor, a heading) that exists; the
    docs pages are checked by `mkdocs build --strict` in make lint."""
    import re

    def anchor(heading: str) -> str:  # mkdocs' and GitHub's slug: lower case, punctuation dropped, spaces to -
        return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))

    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) >= 10
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, fragment = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.exists(), f"README links to {link}, which does not exist"
        if fragment:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert fragment in {anchor(h) for h in headings}, f"README links to {link}: no such heading"
