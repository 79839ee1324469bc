"""docs/architecture.md names only what exists: every `src/epp/...` path is a file or
directory, every dotted `epp.x.y` name imports (a module, then attributes of it), every
`tests/...` path exists and every relative link points at a file. The page is read as
written; a renamed module or class fails here until the page follows."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"

PATH = re.compile(r"(?<![\w/.])((?:src/epp|tests)(?:/[\w.-]+)*/?)")
DOTTED = re.compile(r"(?<![\w/.-])(epp(?:\.\w+)+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def missing_paths(text: str) -> list[str]:
    found = {m.rstrip(".") for m in PATH.findall(text)}
    return sorted(p for p in found if not (ROOT / p).exists())


def resolves(name: str) -> bool:
    """A module, or attributes reached from the longest module prefix that imports."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def missing_names(text: str) -> list[str]:
    return sorted(n for n in set(DOTTED.findall(text)) if not resolves(n))


def missing_links(text: str, base: Path) -> list[str]:
    links = {link for link in LINK.findall(text) if "://" not in link}
    return sorted(link for link in links if not (base / link).exists())


def test_every_path_on_the_page_exists():
    assert missing_paths(PAGE.read_text()) == []


def test_every_dotted_name_on_the_page_imports():
    assert missing_names(PAGE.read_text()) == []


def test_every_relative_link_on_the_page_points_at_a_file():
    assert missing_links(PAGE.read_text(), PAGE.parent) == []


def test_the_page_names_enough_to_be_checked():
    text = PAGE.read_text()
    assert len(set(PATH.findall(text))) >= 20
    assert len(set(DOTTED.findall(text))) >= 20


def test_the_checks_catch_a_name_that_does_not_exist():
    text = (
        "`src/epp/routing/router.py` `src/epp/routing/nowhere.py` `src/epp/routing/`"
        " epp.routing.router.Router.route epp.routing.router.Router.nothing"
        " epp.routing.nowhere.Thing epp.wiring [x](benchmarks/README.md) [y](nowhere.md)"
    )
    assert missing_paths(text) == ["src/epp/routing/nowhere.py"]
    assert missing_names(text) == ["epp.routing.nowhere.Thing", "epp.routing.router.Router.nothing"]
    assert missing_links(text, PAGE.parent) == ["nowhere.md"]
