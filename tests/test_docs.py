"""Every code block in the docs runs as written, and every public name is documented.

Conventions for fenced blocks in ``docs/*.md`` and ``README.md``:

- a ```` ```python ```` block runs as a script under plain ``python`` (a world of 1);
- preceded by ``<!-- torchrun: N -->`` it runs under ``torchrun --standalone --nproc_per_node=N``;
- preceded by ``<!-- illustrative: reason -->`` it is not run (the reason is required);
- any other language (bash, console, text) must be marked illustrative;
- MyST directives (```` ```{toctree} ````, ```` ```{eval-rst} ````) are not code.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _dist import REPO, run_command, run_torchrun

import metadist

DOC_FILES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
FENCE = re.compile(
    r"(?:<!--\s*(?P<marker>[a-z]+):\s*(?P<arg>[^>]*?)\s*-->\s*\n)?"
    r"^(?P<fence>```+)(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=fence)\s*$",
    re.M | re.S,
)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    marker: str | None
    arg: str
    body: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for path in DOC_FILES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            lang = match["lang"].strip()
            if lang.startswith("{"):  # a MyST directive, not code
                continue
            found.append(
                Block(
                    path=path,
                    line=text.count("\n", 0, match.start("fence")) + 1,
                    lang=lang,
                    marker=match["marker"],
                    arg=(match["arg"] or "").strip(),
                    body=match["body"],
                )
            )
    return found


BLOCKS = _blocks()
RUNNABLE = [b for b in BLOCKS if b.marker != "illustrative"]


def test_docs_have_code_blocks() -> None:
    assert len(BLOCKS) >= 3, [b.id for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_is_runnable_or_says_why_not(block: Block) -> None:
    if block.marker == "illustrative":
        assert block.arg, f"{block.id}: an illustrative block must give its reason"
        return
    assert block.marker in (None, "torchrun"), f"{block.id}: unknown marker {block.marker!r}"
    assert block.lang == "python", (
        f"{block.id}: a {block.lang or 'plain'} block must be marked "
        f"<!-- illustrative: reason --> or be python"
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.body)
    env = {"PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    if block.marker == "torchrun":
        result = run_torchrun(script, int(block.arg), timeout=180, env=env, cwd=tmp_path)
    else:
        result = run_command([sys.executable, str(script)], timeout=180, env=env, cwd=tmp_path)
    assert result.returncode == 0, (
        f"{block.id} failed (exit {result.returncode})\n--- code ---\n{block.body}"
        f"\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )


def test_every_public_name_is_in_the_api_reference() -> None:
    reference = "\n".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    documented = set(re.findall(r"^\s+(?:metadist\.)?([A-Za-z_][\w.]*)\s*$", reference, re.M))
    missing = [name for name in metadist.__all__ if name not in documented]
    assert not missing, f"public names missing from the API reference (docs/api.md): {missing}"


def test_every_public_name_has_a_docstring_with_an_example() -> None:
    lacking = []
    for name in metadist.__all__:
        obj = getattr(metadist, name)
        if isinstance(obj, (str, int, float, tuple)):
            continue
        doc = getattr(obj, "__doc__", None) or ""
        if "Example" not in doc:
            lacking.append(name)
    assert not lacking, f"public names without a docstring example: {lacking}"
