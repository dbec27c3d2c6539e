"""Every code block in the docs runs as written, and every public name is documented.

Conventions for fenced blocks in ``docs/*.md`` and ``README.md``:

- a ```` ```python ```` block runs as a script under plain ``python`` (a world of 1);
- preceded by ``<!-- torchrun: N -->`` it runs under ``torchrun --standalone --nproc_per_node=N``
  only (it needs N workers; the rendered docs say so above the block, see ``docs/conf.py``);
  ``<!-- torchrun: N, python -->`` runs it both ways, for a page that offers both;
- preceded by ``<!-- illustrative: reason -->`` it is not run (the reason is required);
- preceded by ``<!-- requires: torchopt -->`` it runs under plain ``python`` with TorchOpt
  importable, and is skipped (with the reason shown) where TorchOpt is not installed (under CI,
  ``CI=true``, it fails instead): metadist does not depend on it. Besides the environment,
  ``.bench-deps/torchopt`` (where ``benchmarks/bench_maml.py`` expects it) is searched;
- any other language (bash, console, text) must be marked illustrative;
- MyST directives (```` ```{toctree} ````, ```` ```{eval-rst} ````) are not code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from _dist import REPO, run_command, run_torchrun, skip_or_fail

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


# How many code blocks each page holds. A block added or removed changes a number here on purpose,
# so that a page whose blocks stopped being found (a changed fence, a moved file) fails.
EXPECTED_BLOCKS = {
    "README.md": 4,
    "docs/autograd.md": 5,
    "docs/concepts.md": 6,
    "docs/index.md": 2,
    "docs/maml.md": 6,
    "docs/migrating.md": 12,
    "docs/multinode.md": 7,
    "docs/optim.md": 5,
    "docs/performance.md": 12,
    "docs/quickstart.md": 3,
    "docs/remote_calls.md": 5,
    "docs/security.md": 1,
    "docs/troubleshooting.md": 22,
}


def test_every_code_block_is_found() -> None:
    found: dict[str, int] = {}
    for block in BLOCKS:
        page = str(block.path.relative_to(REPO))
        found[page] = found.get(page, 0) + 1
    assert found == EXPECTED_BLOCKS


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_is_runnable_or_says_why_not(block: Block) -> None:
    if block.marker == "illustrative":
        assert block.arg, f"{block.id}: an illustrative block must give its reason"
        return
    assert block.marker in (None, "torchrun", "requires"), (
        f"{block.id}: unknown marker {block.marker!r}"
    )
    if block.marker == "requires":
        assert block.arg in OPTIONAL_PACKAGES, f"{block.id}: unknown requirement {block.arg!r}"
    assert block.lang == "python", (
        f"{block.id}: a {block.lang or 'plain'} block must be marked "
        f"<!-- illustrative: reason --> or be python"
    )


# Packages a doc block may require (metadist does not depend on them): name -> (where benchmarks
# install them when they are not in the environment, how to install them there).
OPTIONAL_PACKAGES = {
    "torchopt": (
        REPO / ".bench-deps" / "torchopt",
        "pip install --target .bench-deps/torchopt torchopt==0.7.3 optree graphviz --no-deps",
    )
}


def _optional_package_path(name: str) -> str | None:
    """A PYTHONPATH entry that makes ``name`` importable ("" if it already is), else None."""
    if importlib.util.find_spec(name) is not None:
        return ""
    target = OPTIONAL_PACKAGES[name][0]
    return str(target) if (target / name / "__init__.py").is_file() else None


def launchers(block: Block) -> list[int | None]:
    """How a block runs: ``None`` for plain ``python``, N for ``torchrun`` with N workers."""
    if block.marker != "torchrun":
        return [None]
    parts = [part.strip() for part in block.arg.split(",")]
    assert parts[0].isdigit(), f"{block.id}: expected torchrun: N, got {block.arg!r}"
    assert int(parts[0]) >= 1, f"{block.id}: expected torchrun: N >= 1, got {block.arg!r}"
    assert set(parts[1:]) <= {"python"}, f"{block.id}: after N only 'python', got {block.arg!r}"
    return [int(parts[0]), *([None] if "python" in parts[1:] else [])]


def _run_id(block: Block, launcher: int | None) -> str:
    return f"{block.id}-{'python' if launcher is None else f'torchrun{launcher}'}"


RUNS = [
    pytest.param(block, launcher, id=_run_id(block, launcher))
    for block in RUNNABLE
    if block.lang == "python"
    for launcher in launchers(block)
]


def test_pages_say_how_their_blocks_run() -> None:
    """The marker that runs a block is what the rendered page shows above it (docs/conf.py)."""
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import conf
    finally:
        sys.path.remove(str(REPO / "docs"))
    for path in DOC_FILES:
        if path.parent != REPO / "docs":
            continue
        text = path.read_text()
        rendered = conf.launcher_note(text)
        for block in BLOCKS:
            if block.path == path and block.marker == "torchrun":
                n = launchers(block)[0]
                assert f"Runs on {n} workers: `torchrun --standalone --nproc_per_node={n}" in (
                    rendered
                ), block.id
    # A page that claims every block runs under plain python has no block that needs workers.
    for block in BLOCKS:
        text = block.path.read_text()
        if re.search(r"[Ee]very block on this page runs[^.]*under\s+plain\s+`python`", text):
            assert None in launchers(block), f"{block.id}: the page says plain python runs it"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("block", "launcher"), RUNS)
def test_python_block_runs(block: Block, launcher: int | None, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.body)
    env = {"PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    if block.marker == "requires":
        extra = _optional_package_path(block.arg)
        if extra is None:
            skip_or_fail(
                f"{block.id} needs {block.arg}, which metadist does not depend on; to run it: "
                f"{OPTIONAL_PACKAGES[block.arg][1]}"
            )
        if extra:
            env["PYTHONPATH"] = f"{REPO}{os.pathsep}{extra}"
    if launcher is not None:
        result = run_torchrun(script, launcher, timeout=180, env=env, cwd=tmp_path)
    else:
        result = run_command([sys.executable, str(script)], timeout=180, env=env, cwd=tmp_path)
    assert result.returncode == 0, (
        f"{block.id} failed (exit {result.returncode})\n--- code ---\n{block.body}"
        f"\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )


PUBLIC_MODULES = (metadist, metadist.optim, metadist.autograd)


def _public_objects() -> list[tuple[str, object]]:
    """``(qualified name, object)`` for every public non-module name, each object once."""
    seen: dict[int, tuple[str, object]] = {}
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if not isinstance(obj, types.ModuleType):
                seen.setdefault(id(obj), (f"{module.__name__}.{name}", obj))
    return list(seen.values())


def test_every_public_name_is_in_the_api_reference() -> None:
    reference = (REPO / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\s+(?:metadist\.)?([A-Za-z_][\w.]*)\s*$", reference, re.M))
    missing = [name for name in metadist.__all__ if name not in documented]
    missing += [name for name in metadist.optim.__all__ if name not in documented]
    missing += [
        f"autograd.{name}"
        for name in metadist.autograd.__all__
        if f"autograd.{name}" not in documented
    ]
    assert not missing, f"public names missing from the API reference (docs/api.md): {missing}"


def test_every_public_name_has_a_docstring() -> None:
    lacking = []
    for qualname, obj in _public_objects():
        if isinstance(obj, (str, int, float, tuple)):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            lacking.append(qualname)
    assert not lacking, f"public names without a docstring: {lacking}"


def _section(doc: str, *titles: str) -> str | None:
    """The indented body of the Google-style sections ``titles`` of ``doc`` (None if absent)."""
    body: list[str] = []
    found = False
    for match in re.finditer(rf"^(?P<indent> *)(?:{'|'.join(titles)}):[ \t]*$", doc, re.M):
        found = True
        indent = len(match["indent"])
        for line in doc[match.end() :].split("\n")[1:]:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break
            body.append(line)
    return "\n".join(body) if found else None


def _own_source(func: Callable[..., object]) -> str:
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return ""
    return source.split('"""', 2)[-1]  # the body after the docstring


def _docstring_problems(
    name: str, func: Callable[..., object], doc: str, method: bool
) -> list[str]:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # builtins without a signature
        return []
    problems = []
    params = [
        p for p in signature.parameters.values() if not (method and p.name in ("self", "cls"))
    ]
    args = _section(doc, "Args", "Arguments", "Attributes")
    for param in params:
        if args is None or not re.search(rf"^\s*\**{re.escape(param.name)}\b", args, re.M):
            problems.append(f"{name}: parameter {param.name!r} is not described under Args")
    returns = signature.return_annotation
    returns_something = returns not in (inspect.Signature.empty, None, "None")
    if returns_something and _section(doc, "Returns", "Yields") is None:
        problems.append(f"{name}: returns {returns} but has no Returns section")
    if (
        re.search(r"^\s*raise [A-Z]\w*\(", _own_source(func), re.M)
        and _section(doc, "Raises") is None
    ):
        problems.append(f"{name}: raises but has no Raises section")
    return problems


def test_every_public_callable_documents_args_returns_and_raises() -> None:
    """Google-style sections (rendered by napoleon) for every public function, class and method.

    Every parameter is named under ``Args:`` (for a class: in the class or ``__init__``
    docstring; a dataclass may list its fields under ``Attributes:``); a callable annotated to
    return something has ``Returns:``; one whose own body raises has ``Raises:``. Examples are
    welcome where they teach, not required.
    """
    problems: list[str] = []
    for qualname, obj in _public_objects():
        if inspect.isclass(obj):
            doc = inspect.getdoc(obj) or ""
            if "__init__" in vars(obj) or dataclasses.is_dataclass(obj):
                init_doc = inspect.getdoc(obj.__init__) if "__init__" in vars(obj) else ""
                problems += _docstring_problems(
                    f"{qualname}.__init__", obj.__init__, f"{doc}\n{init_doc or ''}", True
                )
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, property):
                    if not (member.__doc__ or "").strip():
                        problems.append(f"{qualname}.{attr}: property without a docstring")
                    continue
                func = (
                    member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                )
                if not inspect.isfunction(func):
                    continue
                func_doc = inspect.getdoc(func) or ""
                if not func_doc.strip():
                    problems.append(f"{qualname}.{attr}: method without a docstring")
                problems += _docstring_problems(f"{qualname}.{attr}", func, func_doc, True)
        elif callable(obj):
            problems += _docstring_problems(qualname, obj, inspect.getdoc(obj) or "", False)
    assert not problems, "\n".join(problems)


DOCTEST_RUNNER = """
import doctest, importlib, pkgutil, sys
import metadist
failed = attempted = 0
names = ["metadist", *(m.name for m in pkgutil.walk_packages(metadist.__path__, "metadist."))]
for name in names:
    result = doctest.testmod(
        importlib.import_module(name),
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    print(f"{name}: {result.attempted} examples, {result.failed} failed", flush=True)
    failed += result.failed
    attempted += result.attempted
print(f"total: {attempted} examples, {failed} failed")
sys.exit(1 if failed or not attempted else 0)
"""


@pytest.mark.timeout(300)
def test_docstring_examples_run() -> None:
    """Every docstring example of the package runs as a doctest and checks its output.

    Examples that call remote functions run as a world of 1 inside
    ``@metadist.auto_init_rpc()``. They run in one fresh process, so that RPC started by an
    example never touches this test process.
    """
    env = {"PYTHONPATH": str(REPO)}
    result = run_command([sys.executable, "-c", DOCTEST_RUNNER], timeout=240, env=env)
    assert result.returncode == 0, f"doctests failed:\n{result.stdout}\n{result.stderr}"
