"""Sphinx configuration for metadist's documentation (built offline, warnings are errors)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import metadist

if TYPE_CHECKING:
    from sphinx.application import Sphinx

project = "metadist"
author = "metadist developers"
copyright = "2026, metadist developers"
release = metadist.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = "metadist"
# Offline build: no intersphinx, no remote images. Every warning is an error under `make docs`
# (-W), broken cross-references included.
nitpicky = False


# A block that needs N workers carries `<!-- torchrun: N -->` in the page source (tests/test_docs.py
# runs it so; `torchrun: N, python` runs it under plain python too); the comment does not render,
# so say it in the page too, just above the block.
LAUNCHER = re.compile(r"^<!--\s*torchrun:\s*(\d+)\s*(,\s*python\s*)?-->[ \t]*$", re.M)


def launcher_note(text: str) -> str:
    """``text`` with a visible line naming the launcher above every ``torchrun: N`` block."""

    def note(m: re.Match[str]) -> str:
        alone = "; or alone, as a world of 1: `python script.py`" if m[2] else ""
        return (
            f"*Runs on {m[1]} workers: `torchrun --standalone --nproc_per_node={m[1]} "
            f"script.py`{alone}.*\n\n{m[0]}"
        )

    return LAUNCHER.sub(note, text)


def _source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    source[0] = launcher_note(source[0])


def setup(app: Sphinx) -> None:
    app.connect("source-read", _source_read)
