"""A backend is one folder: outside `launcher/backends/<name>/` only the registry imports it, and
only the config schema names its strategies (docs/architecture.md "Adding a backend"); a backend
that builds on another (Backend.builds_on, e.g. fsdp1 on fsdp2's layout machinery) may import it. Checked on
the source itself (the static import graph and string literals), for every registered backend.

What still reaches further is listed in `OLDER` and may only shrink: a listed file that no longer
refers to its backend fails the test too, so the list is kept exact. Today it is empty."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from launcher.backends.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "launcher"
REGISTRY_FILE = "launcher/backends/registry.py"
SCHEMA_FILE = "launcher/config.py"

# backend -> (files outside its folder that import it, files that spell one of its strategy names)
OLDER: dict[str, tuple[set[str], set[str]]] = {}


def references(name: str, strategies: set[str], source: str) -> tuple[bool, bool]:
    """(does `source` import launcher.backends.<name>, does it spell one of `strategies`)."""
    imports = literals = False
    package = f"launcher.backends.{name}"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imports |= node.module == package or node.module.startswith(package + ".")
            imports |= node.module == "launcher.backends" and any(a.name == name for a in node.names)
        elif isinstance(node, ast.Import):
            imports |= any(a.name == package or a.name.startswith(package + ".") for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            literals |= node.value in strategies
    return imports, literals


def footprint(name: str) -> tuple[set[str], set[str]]:
    """Files outside the backend's folder, and outside the folders of backends that build on it
    (Backend.builds_on), that import it or spell its strategy names."""
    folder = PACKAGE / "backends" / name
    builders = [PACKAGE / "backends" / b.name for b in REGISTRY.values() if name in b.builds_on]
    strategies = set(REGISTRY[name].strategies)
    importers, spellers = set(), set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if folder in path.parents or any(f in path.parents for f in builders):
            continue
        imports, literals = references(name, strategies, path.read_text())
        relative = str(path.relative_to(ROOT))
        if imports:
            importers.add(relative)
        if literals:
            spellers.add(relative)
    return importers, spellers


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_backend_is_reached_only_through_the_registry_and_the_schema(name):
    importers, spellers = footprint(name)
    older_importers, older_spellers = OLDER.get(name, (set(), set()))
    assert importers == {REGISTRY_FILE} | older_importers, (
        f"{name}: imported outside its folder by {sorted(importers - {REGISTRY_FILE} - older_importers)}; "
        f"no longer by {sorted(older_importers - importers)} (shrink OLDER)")
    assert spellers - {SCHEMA_FILE} == older_spellers, (
        f"{name}: strategy names spelled outside its folder in {sorted(spellers - {SCHEMA_FILE} - older_spellers)}; "
        f"no longer in {sorted(older_spellers - spellers)} (shrink OLDER)")


def test_fsdp2_needs_nothing_outside_its_folder_but_the_registry_line_and_its_knobs():
    """The backend built on the registry: one import in the registry, its knobs in the schema."""
    assert "fsdp2" not in OLDER
    assert footprint("fsdp2") == ({REGISTRY_FILE}, {SCHEMA_FILE})
    registry_lines = [line for line in (ROOT / REGISTRY_FILE).read_text().splitlines() if "fsdp2" in line]
    assert len(registry_lines) == 2, registry_lines  # the import and its entry in _BACKENDS


def test_the_footprint_check_sees_an_import_and_a_strategy_name():
    """The checker itself: a planted import and a planted strategy name are both found."""
    assert references("fsdp2", {"fsdp2_tp"}, "from launcher.backends.fsdp2.rules import x\n") == (True, False)
    assert references("fsdp2", {"fsdp2_tp"}, "from launcher.backends import ddp, fsdp2\n") == (True, False)
    assert references("fsdp2", {"fsdp2_tp"}, "if s.name == 'fsdp2_tp': pass\n") == (False, True)
    assert references("fsdp2", {"fsdp2_tp"}, "# fsdp2_tp in a comment\nx = 'fsdp2_tpx'\n") == (False, False)
