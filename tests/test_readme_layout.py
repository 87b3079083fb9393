"""README.md's layout block names every module of python/ds4/ and every
source file of rust/ (its tests aside): read at run time, so a module added
without its line fails here.

A top-level module is named at the head of a line of the block (before the
description); a module of a subpackage anywhere in its folder's entry (the
line that opens with ``kvstore/`` and the deeper-indented lines after it).
A package's ``__init__.py`` is its folder's entry; the extension module is
named by its stub, ``_core.pyi``."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "python" / "ds4"


def layout_entries(top: str = "python/ds4/") -> dict[str, str]:
    """The ``top`` part of the layout block: each entry's head (the names
    before the description) -> the entry's whole text."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split("  ")[0] == top)
    entries: dict[str, str] = {}
    head = None
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break  # the next top-level folder
        if not line.startswith("   "):  # two spaces: an entry opens
            head = re.split(r"\s{2,}", line.strip())[0]
            entries[head] = line
        elif head is not None:
            entries[head] += "\n" + line
    return entries


def modules() -> list[pathlib.Path]:
    found = [p for p in PKG.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts]
    return sorted([*found, PKG / "_core.pyi"])


def test_the_layout_block_is_found():
    entries = layout_entries()
    assert any("config.py" in h.split() for h in entries), entries
    assert "server/" in entries and "cli/" in entries


def unnamed(top: str, files: list[pathlib.Path], base: pathlib.Path) -> list[str]:
    """The ``files`` (below ``base``) the layout block's ``top`` part does
    not name: a top-level one at the head of an entry, a deeper one anywhere
    in its folder's entry."""
    entries = layout_entries(top)
    heads = {name for h in entries for name in h.split()}
    missing = []
    for p in files:
        rel = p.relative_to(base)
        if len(rel.parts) == 1:
            ok = rel.name in heads
        else:
            entry = entries.get("/".join(rel.parts[:-1]) + "/", "")
            ok = re.search(rf"(?<![\w.]){re.escape(rel.name)}(?![\w])", entry) is not None
        if not ok:
            missing.append(str(rel))
    return missing


def test_every_module_is_in_the_readme_layout():
    missing = unnamed("python/ds4/", modules(), PKG)
    assert missing == [], f"README.md's layout block does not name: {', '.join(missing)}"


def test_every_rust_source_is_in_the_readme_layout():
    rust = ROOT / "rust"
    entries = layout_entries("rust/")
    assert "verify.rs" in {n for h in entries for n in h.split()} and "index/" in entries, entries
    # the integration tests (rust/tests/) and a module's unit tests (tests.rs) aside
    files = [p for p in sorted(rust.rglob("*.rs")) if p.relative_to(rust).parts[0] != "tests" and p.name != "tests.rs"]
    missing = unnamed("rust/", files, rust)
    assert missing == [], f"README.md's layout block does not name: {', '.join(missing)}"
