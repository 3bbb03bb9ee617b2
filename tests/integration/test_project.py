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


MAX_FUNCTION_LINES = 80  # a function a reader follows in one go (issue: no function over 80 lines)


def test_no_function_of_the_library_or_the_code_location_is_over_80_lines():
    """Every function and method in speculators/ and speculators_assets/, from its `def` line to its last
    line (decorators left out), fits MAX_FUNCTION_LINES; a longer one is split along its seams."""
    import ast

    long = []
    for package in ("speculators", "speculators_assets"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_readme_module_map_names_every_module_of_the_tree():
    """README.md's module map matches the tree: each module of the library and the code location is named
    in it (by its file name, under its package's line), and each file name it lists exists."""
    import re

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Module map", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}  # package folder -> the text of its entry (the first line and its continuations)
    package = ""
    for line in block.splitlines():
        if line and not line.startswith(" "):
            package = line.split()[0]
            package = package if package.endswith("/") else package.rsplit("/", 1)[0] + "/"
        entries[package] = entries.get(package, "") + " " + line
    for root in ("speculators", "speculators_assets"):
        for path in sorted((ROOT / root).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            folder = path.parent.relative_to(ROOT).as_posix() + "/"
            assert re.search(rf"\b{re.escape(path.name)}\b", entries.get(folder, "")), (
                f"README's module map does not name {path.relative_to(ROOT)} under {folder}"
            )
    for folder, text in entries.items():
        for name in re.findall(r"\b(\w+\.py)\b", text):
            assert (ROOT / folder / name).is_file(), f"README's module map names {folder}{name}, which does not exist"
