"""Layers point down: a kiln package imports only packages of lower layers (docs/architecture.md).

Every `import` in src/python/kiln, lazy ones inside functions included, is read with `ast`; an
import of a package in the same or a higher layer fails, naming the file, the line and the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln_testing.data import REPO_ROOT

# Lowest first. A package may import the packages of the layers below its own, never its own
# layer's other packages nor anything above. `artifacts`, `containment`, `lifetime` and `runner`
# are modules (kiln/*.py).
# Below them all lies kiln_contract (src/contract), shared with the Pants backend: stdlib only.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("artifacts", "containment", "lifetime", "kernels"),
    ("data", "model", "control"),
    ("eval",),
    ("train",),
    ("report", "interop", "cluster", "fit"),
    ("runner",),
)
LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}
RUNTIME = REPO_ROOT / "src/python/kiln"


@dataclass(frozen=True)
class Import:
    file: Path  # relative to the source root (src/python)
    line: int
    importer: str  # the kiln unit (package or top-level module) of the file
    imported: str  # the kiln unit it imports


def kiln_unit(module: str) -> str | None:
    """'kiln.train.step' -> 'train'; None for 'kiln' itself and for other top-level names."""
    parts = module.split(".")
    return parts[1] if parts[0] == "kiln" and len(parts) > 1 else None


def imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The absolute module names an import statement names ('from kiln import x' -> 'kiln.x')."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        parts = module.split(".")
        base = ".".join(parts[: len(parts) - node.level + is_package] + [base] * bool(base))
    # An imported name may be a module ('from kiln import data'): each one counts.
    return [f"{base}.{alias.name}" for alias in node.names]


def kiln_imports(source_root: Path) -> Iterator[Import]:
    for path in sorted((source_root / "kiln").rglob("*.py")):
        relative = path.relative_to(source_root)
        module = ".".join(relative.with_suffix("").parts)
        is_package = path.name == "__init__.py"
        module = module.removesuffix(".__init__")
        importer = kiln_unit(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in imported_modules(node, module, is_package):
                imported = kiln_unit(name)
                if imported is not None and importer is not None and imported != importer:
                    yield Import(relative, node.lineno, importer, imported)


def units(source_root: Path) -> set[str]:
    kiln = source_root / "kiln"
    return {p.stem for p in kiln.glob("*.py") if p.name != "__init__.py"} | {
        p.name for p in kiln.iterdir() if (p / "__init__.py").is_file()
    }


def violations(source_root: Path) -> list[str]:
    unplaced = sorted(units(source_root) - set(LAYER_OF))
    if unplaced:
        return [
            f"kiln.{unit} has no layer: add it to LAYERS in {Path(__file__).name} and to the "
            "layering in docs/architecture.md"
            for unit in unplaced
        ]
    return [
        f"{i.file}:{i.line}: kiln.{i.importer} (layer {LAYER_OF[i.importer]}) imports "
        f"kiln.{i.imported} (layer {LAYER_OF.get(i.imported, '?')}): a package imports only "
        "lower layers"
        for i in kiln_imports(source_root)
        if LAYER_OF.get(i.imported, len(LAYERS)) >= LAYER_OF[i.importer]
    ]


def test_the_runtime_layers_point_down() -> None:
    assert {"data", "model", "train", "report", "runner"} <= units(RUNTIME.parent)
    assert violations(RUNTIME.parent) == []


def write_module(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    for folder in path.relative_to(root).parents:
        if folder != Path(".") and not (root / folder / "__init__.py").exists():
            (root / folder / "__init__.py").write_text("")
    path.write_text(text)


def test_an_upward_or_sideways_import_is_reported(tmp_path: Path) -> None:
    write_module(tmp_path, "kiln/report/plots.py", "")
    write_module(tmp_path, "kiln/model/llama.py", "")
    write_module(tmp_path, "kiln/data/cache.py", "from kiln.artifacts import lease\n")
    write_module(tmp_path, "kiln/artifacts.py", "")
    write_module(
        tmp_path,
        "kiln/train/trainer.py",
        "import kiln.data.cache\nfrom ..model import llama\n\n\n"
        "def plot():\n    from kiln.report.plots import write\n",
    )
    write_module(tmp_path, "kiln/data/mixture.py", "from kiln import model\n")
    assert violations(tmp_path) == [
        "kiln/data/mixture.py:1: kiln.data (layer 1) imports kiln.model (layer 1): "
        "a package imports only lower layers",
        "kiln/train/trainer.py:6: kiln.train (layer 3) imports kiln.report (layer 4): "
        "a package imports only lower layers",
    ]


def test_a_package_without_a_layer_is_reported(tmp_path: Path) -> None:
    write_module(tmp_path, "kiln/serving/server.py", "")
    assert violations(tmp_path) == [
        "kiln.serving has no layer: add it to LAYERS in test_layers.py and to the layering in "
        "docs/architecture.md"
    ]
