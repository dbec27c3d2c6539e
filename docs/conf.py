"""Sphinx configuration for metadist's documentation (built offline, warnings are errors)."""

from __future__ import annotations

import metadist

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
# Offline build: no intersphinx, no remote images.
nitpicky = False
suppress_warnings = ["myst.xref_missing"]
