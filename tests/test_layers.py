"""The package's layers, kept: a module imports only from its own layer or the layers below it.

The layers, bottom to top (docs/architecture.md draws them):

0. values and plans: layouts, strategies, partitioners, plans, the array seam, the reference model
   and optimizer as pure array functions, observations, verdicts, errors and exit statuses.
1. contracts, pure checks and cost models: functions of values that return verdicts or estimates.
2. comm and engine: the Communicator seam and the in-process simulator, the ZeRO engine, its run
   configuration and results, the unsharded references.
3. backends: MPI (mpi4py) and torch.distributed (zerogpu), their launchers and rank-side programs.
4. interface: reports, benchmarks a user starts, verify, testing helpers, the package's public names.
5. entry points: the ``__main__`` modules of the backends and of verify, which ``python -m`` starts on
   every rank; each takes one argument, the run file its launcher wrote, and parses nothing (given
   options, it hands them to the command line by starting it, never by importing it).
6. command line: ``zerosim.cli``, alone at the top (with ``zerosim.__main__``, its ``python -m zerosim``
   shim): every argparse parser, one module per subcommand; no module below imports it.

``LAYERS`` is the one table that places every module. A new module is placed by its package's
entry (``"zerosim.cli"`` covers ``zerosim.cli.plan``); a module no entry covers fails
:func:`test_every_module_has_a_layer` until it is added. Imports are read from the source (every
``import`` statement, including those inside functions, and the modules named by a string that
``importlib.import_module`` or ``__import__`` is given), so neither a lazy nor a dynamic import can hide
an upward edge or a cycle. The upward edges that remain today are listed, each with its reason, in
:data:`ALLOWED_UPWARD`; any other fails :func:`test_no_module_imports_from_a_layer_above_it`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zerosim", "zerogpu")
LAYER_NAMES = ("values and plans", "contracts, checks and cost models", "comm and engine", "backends",
               "interface (report, bench, verify, testing)", "entry points", "command line")

#: module -> layer index into LAYER_NAMES; ``"pkg.*"`` places the package ``pkg`` and every module under it
#: (a more specific entry wins: ``zerosim.comm.*`` is layer 2, ``zerosim.comm.mpi`` layer 3)
LAYERS: dict[str, int] = {
    # 0: values and plans
    "zerosim.errors": 0, "zerosim.values.*": 0, "zerosim.numerics.*": 0, "zerosim.partition.*": 0,
    "zerosim.files.*": 0,
    # 1: contracts, pure checks, cost models
    "zerosim.checks.*": 1, "zerosim.cost.*": 1, "zerosim.checks.rounding": 1,
    # 2: comm and engine
    "zerosim.comm.*": 2, "zerosim.engine.*": 2, "zerosim.checkpoint.*": 2, "zerosim.engine.schedule": 2,
    "zerosim.engine.block_schedule": 2, "zerosim.engine.wire": 2, "zerosim.engine.rank_groups": 2,
    "zerosim.engine.finite_vote": 2,
    # 3: backends
    "zerosim.comm.mpi": 3, "zerosim.comm.mpi_wire": 3, "zerosim.comm.mpi_traffic": 3,
    "zerosim.comm.mpi_watchdog": 3, "zerosim.mpi.*": 3, "zerosim.processes.*": 3, "zerosim.bench.mpi": 3,
    "zerogpu.*": 3, "zerogpu.module_run": 3, "zerogpu.fork_server": 3, "zerosim.monitor.*": 3,
    # 4: interface
    "zerosim": 4, "zerosim.report.*": 4, "zerosim.bench.*": 4, "zerosim.verify.*": 4, "zerosim.testing.*": 4,
    "zerosim.zoo.*": 4, "zerogpu.gpu_report": 4,
    # 5: the ranks' entry points: ``python -m`` of the backends and of verify, each given one run file
    "zerosim.mpi.__main__": 5, "zerogpu.__main__": 5, "zerosim.verify.__main__": 5,
    # 6: the command line, alone at the top, and ``python -m zerosim``, which is nothing but its shim
    "zerosim.cli.*": 6, "zerosim.__main__": 6,
}

#: the upward imports that remain, (importer, imported) -> why; every other upward import fails the test,
#: and so does an entry here that no longer matches an import (remove it when its edge goes)
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def module_files() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def layer_of(module: str, table: dict[str, int] = LAYERS) -> int | None:
    """The layer of ``module``: its own entry, else the closest ``"pkg.*"`` entry above it; None if none."""
    if module in table:
        return table[module]
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end]) + ".*"
        if key in table:
            return table[key]
    return None


def dynamic_imports(tree: ast.AST, known: set[str]) -> set[str]:
    """The modules a source imports by name at run time: the string given to ``importlib.import_module``
    or ``__import__``; where a call is given a computed name (a table's entry), every dotted string in
    the source that names a module of the packages (the candidates the name is chosen from)."""
    found: set[str] = set()
    computed = False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in ("import_module", "__import__"):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.add(arg.value)
        else:
            computed = True
    if computed:
        found.update(n.value for n in ast.walk(tree)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str) and "." in n.value
                     and n.value in known)
    return found


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the packages that ``module`` imports anywhere in its source, resolved to modules
    (``from zerosim.report import figures`` is ``zerosim.report.figures`` when that is a module), and
    those it imports by name (:func:`dynamic_imports`). Imports under ``if TYPE_CHECKING:`` count:
    annotations tie modules together too."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = dynamic_imports(tree, known)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def upward_edges(table: dict[str, int] = LAYERS) -> list[tuple[str, str]]:
    """Every (importer, imported) pair whose imported module sits in a layer above the importer's."""
    files = module_files()
    known = set(files)
    edges = []
    for module, path in files.items():
        mine = layer_of(module, table)
        for target in sorted(imports_of(module, path, known)):
            theirs = layer_of(target, table)
            if mine is not None and theirs is not None and theirs > mine:
                edges.append((module, target))
    return edges


def upward_imports(table: dict[str, int] = LAYERS,
                   allowed: dict[tuple[str, str], str] = ALLOWED_UPWARD) -> list[str]:
    """One line per import of a module from a layer above the importer's, but those ``allowed``."""
    problems = []
    for module, target in upward_edges(table):
        if (module, target) not in allowed:
            mine, theirs = layer_of(module, table), layer_of(target, table)
            assert mine is not None and theirs is not None
            problems.append(f"{module} (layer {mine}: {LAYER_NAMES[mine]}) imports {target} "
                            f"(layer {theirs}: {LAYER_NAMES[theirs]}), a layer above it")
    return problems


def copy_packages(root: Path) -> None:
    """A copy of the packages' sources under ``root``, for a check to run on a deliberately broken tree."""
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            dest = root / path.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(path.read_text())


def test_every_module_has_a_layer():
    unplaced = [m for m in module_files() if layer_of(m) is None]
    assert not unplaced, (f"modules with no layer: {unplaced}; add each (or its package) to LAYERS in "
                          f"tests/test_layers.py and to the picture in docs/architecture.md")


def test_every_table_entry_names_a_module():
    files = module_files()
    stale = [k for k in LAYERS if k.removesuffix(".*") not in files]
    assert not stale, f"LAYERS entries that match no module (renamed or removed?): {stale}"


def test_no_module_imports_from_a_layer_above_it():
    problems = upward_imports()
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_every_allowed_upward_import_still_exists():
    """An allowance whose import is gone is removed, so the list shows exactly today's exceptions."""
    stale = sorted(set(ALLOWED_UPWARD) - set(upward_edges()))
    assert not stale, f"ALLOWED_UPWARD entries that no longer match an upward import: {stale}"


#: the command line's package, and the one module outside it that may import it (``python -m zerosim``)
CLI_SHIM = "zerosim.__main__"


def test_the_command_line_is_alone_at_the_top_above_the_entry_points():
    """Layer 6 holds the cli (and its ``python -m zerosim`` shim) and nothing else; layer 5 holds every
    other ``__main__`` module and nothing else."""
    files = module_files()
    top = {m for m in files if layer_of(m) == len(LAYER_NAMES) - 1}
    assert top == {m for m in files if m == "zerosim.cli" or m.startswith("zerosim.cli.")} | {CLI_SHIM}
    entry = {m for m in files if layer_of(m) == len(LAYER_NAMES) - 2}
    assert entry == {m for m in files if m.endswith(".__main__")} - {CLI_SHIM}


def cli_importers() -> list[str]:
    """Every module outside ``zerosim.cli`` (and its shim) that imports a module of ``zerosim.cli``."""
    files = module_files()
    known = set(files)
    return sorted(f"{m} imports {t}" for m, p in files.items()
                  if m != CLI_SHIM and not (m == "zerosim.cli" or m.startswith("zerosim.cli."))
                  for t in imports_of(m, p, known) if t == "zerosim.cli" or t.startswith("zerosim.cli."))


def test_no_module_outside_the_command_line_imports_it():
    """The ranks take a run file; a rank given options starts the command line, never imports it."""
    problems = cli_importers()
    assert not problems, "\n".join(problems)


def test_a_rank_entry_point_importing_the_command_line_is_named(tmp_path, monkeypatch):
    """The check fails on a deliberately added parse on a rank: ``zerogpu.__main__`` importing a parser."""
    copy_packages(tmp_path)
    entry = tmp_path / "zerogpu" / "__main__.py"
    entry.write_text(entry.read_text() + "\n\ndef _parse():\n    from zerosim.cli.run_options import "
                     "torch_simulate_parser\n\n    return torch_simulate_parser()\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert cli_importers() == ["zerogpu.__main__ imports zerosim.cli.run_options"]
    assert upward_imports() == ["zerogpu.__main__ (layer 5: entry points) imports zerosim.cli.run_options "
                                "(layer 6: command line), a layer above it"]


def test_a_dynamic_upward_import_is_reported(tmp_path, monkeypatch):
    """A module named to ``importlib.import_module`` is an import like any other."""
    copy_packages(tmp_path)
    layout = tmp_path / "zerosim" / "values" / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef _wrong():\n    import importlib\n\n"
                      "    return importlib.import_module(\"zerosim.report.build\")\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert upward_imports() == ["zerosim.values.layout (layer 0: values and plans) imports "
                                "zerosim.report.build "
                                "(layer 4: interface (report, bench, verify, testing)), a layer above it"]


def test_an_upward_import_is_reported_with_both_layers(tmp_path, monkeypatch):
    """The check itself fails on a deliberately wrong import: a value module importing the CLI."""
    fake_root = tmp_path
    copy_packages(fake_root)
    layout = fake_root / "zerosim" / "values" / "layout.py"
    layout.write_text(
        layout.read_text() + "\n\ndef _wrong():\n    from zerosim.cli.simulate import run\n    return run\n"
    )
    monkeypatch.setitem(globals(), "ROOT", fake_root)
    problems = upward_imports()
    assert problems == ["zerosim.values.layout (layer 0: values and plans) imports zerosim.cli.simulate "
                        "(layer 6: command line), a layer above it"]


def test_a_module_missing_from_the_table_has_no_layer():
    """A new top-level module is not placed by accident (``zerosim`` itself is an exact entry)."""
    assert layer_of("zerosim.new_concept") is None
    assert layer_of("zerosim.cli.new_command") == 6  # a package entry places its new modules
    assert layer_of("zerosim.comm.sim") == 2 and layer_of("zerosim.comm.mpi_wire") == 3


def import_cycles() -> list[list[str]]:
    """Cycles in the graph of imports, those under ``if TYPE_CHECKING:`` included (a type-only circle
    is still two concepts that know each other); a package and its own submodules are excepted: a
    package's ``__init__`` re-exporting its modules is not a cycle of concepts."""
    files = module_files()
    known = set(files)
    graph = {
        m: {
            t
            for t in imports_of(m, p, known)
            if t in known and not t.startswith(m + ".") and not m.startswith(t + ".")
        }
        for m, p in files.items()
    }
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_type_only_import_cycle_is_reported(tmp_path, monkeypatch):
    """The check fails on a deliberately added circle that exists for annotations only."""
    copy_packages(tmp_path)
    watchdog = tmp_path / "zerosim" / "comm" / "mpi_watchdog.py"
    watchdog.write_text(watchdog.read_text() + "\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                        "    from .mpi import MpiCommunicator\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert ["zerosim.comm.mpi", "zerosim.comm.mpi_watchdog", "zerosim.comm.mpi"] in import_cycles()


def test_an_import_cycle_through_importlib_is_reported(tmp_path, monkeypatch):
    """A circle closed by a module imported by name (the fork server importing the spawner, which
    imports the fork server) is a cycle like any other."""
    copy_packages(tmp_path)
    server = tmp_path / "zerogpu" / "fork_server.py"
    server.write_text(server.read_text() + "\n\ndef _warm():\n    import importlib\n\n"
                      "    importlib.import_module(\"zerogpu.spawn\")\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert any(set(c) == {"zerogpu.fork_server", "zerogpu.spawn"} for c in import_cycles())


#: where command-line parsing lives: every argparse parser of the packages is declared under it
CLI_PACKAGE = "zerosim.cli"


def argparse_importers() -> list[str]:
    """One line per module outside :data:`CLI_PACKAGE` whose source imports ``argparse`` (anywhere in
    the module, inside functions too)."""
    problems = []
    for module, path in module_files().items():
        if module == CLI_PACKAGE or module.startswith(CLI_PACKAGE + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "argparse" or n.startswith("argparse.") for n in names):
                problems.append(f"{module} ({path.relative_to(ROOT)}:{node.lineno}) imports argparse; "
                                f"command-line parsing belongs in {CLI_PACKAGE}")
    return problems


def test_argparse_is_imported_only_by_the_cli():
    problems = argparse_importers()
    assert not problems, "\n".join(problems)


def test_an_argparse_import_outside_the_cli_is_named(tmp_path, monkeypatch):
    """The check fails on a deliberately misplaced parser, naming the module and the line."""
    copy_packages(tmp_path)
    rank = tmp_path / "zerosim" / "mpi" / "rank.py"
    lines = rank.read_text().count("\n")
    rank.write_text(rank.read_text() + "\n\ndef _parser():\n    from argparse import ArgumentParser\n"
                    "    return ArgumentParser()\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert argparse_importers() == [
        f"zerosim.mpi.rank (zerosim/mpi/rank.py:{lines + 4}) imports argparse; command-line parsing "
        "belongs in zerosim.cli"]


ARCHITECTURE = ROOT / "docs" / "architecture.md"
PICTURE_BEGIN = "<!-- layer table: generated from LAYERS in tests/test_layers.py -->"
PICTURE_END = "<!-- end of layer table -->"


def layer_picture(table: dict[str, int] = LAYERS) -> str:
    """The table of layers as docs/architecture.md shows it: one row per layer, every entry named."""
    rows = ["| layer | modules (`pkg.*`: the package and every module under it) |", "|---|---|"]
    for index in range(len(LAYER_NAMES) - 1, -1, -1):
        names = sorted(k for k, v in table.items() if v == index)
        rows.append(f"| {index} {LAYER_NAMES[index]} | " + " ".join(f"`{n}`" for n in names) + " |")
    return "\n".join(rows)


def test_the_architecture_page_shows_the_layer_table():
    """docs/architecture.md carries the table generated from LAYERS, so the page cannot drift from it.
    After changing LAYERS: ``python tests/test_layers.py`` rewrites the page's table."""
    text = ARCHITECTURE.read_text()
    assert PICTURE_BEGIN in text and PICTURE_END in text, f"{ARCHITECTURE} lost its layer table markers"
    shown = text.split(PICTURE_BEGIN, 1)[1].split(PICTURE_END, 1)[0].strip()
    assert shown == layer_picture(), ("docs/architecture.md's layer table differs from LAYERS; run "
                                      "`python tests/test_layers.py` to regenerate it")


def _write_picture() -> None:
    text = ARCHITECTURE.read_text()
    head, rest = text.split(PICTURE_BEGIN, 1)
    tail = rest.split(PICTURE_END, 1)[1]
    ARCHITECTURE.write_text(f"{head}{PICTURE_BEGIN}\n{layer_picture()}\n{PICTURE_END}{tail}")


#: a module longer than this says at its top why it is one module (``Why one module of this length:``)
MODULE_LINES = 400
WHY_ONE_MODULE = "Why one module of this length:"


def long_modules_without_a_reason() -> list[str]:
    """One line per module over :data:`MODULE_LINES` lines whose docstring does not say why."""
    problems = []
    for module, path in module_files().items():
        source = path.read_text()
        lines = source.count("\n")
        doc = ast.get_docstring(ast.parse(source, str(path))) or ""
        if lines > MODULE_LINES and WHY_ONE_MODULE not in " ".join(doc.split()):
            problems.append(f"{module} ({lines} lines) does not say at its top why it is one module "
                            f"({WHY_ONE_MODULE!r}); split it by concern or say why not")
    return problems


def test_every_long_module_says_why_it_is_one():
    problems = long_modules_without_a_reason()
    assert not problems, "\n".join(problems)


def test_a_long_module_without_a_reason_is_named(tmp_path, monkeypatch):
    """The check fails on a deliberately grown module that gives no reason."""
    copy_packages(tmp_path)
    grown = tmp_path / "zerosim" / "values" / "layout.py"
    grown.write_text(grown.read_text() + "\n" * (MODULE_LINES + 1))
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert [p.split(" (")[0] for p in long_modules_without_a_reason()] == ["zerosim.values.layout"]


#: no module is longer than this, reason or not: past it a module is split where a concept separates
MAX_MODULE_LINES = 600


def modules_over_the_limit() -> list[str]:
    """One line per module over :data:`MAX_MODULE_LINES` lines."""
    return [f"{module} has {lines} lines, over {MAX_MODULE_LINES}: split it where a concept separates"
            for module, path in module_files().items()
            if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES]


def test_no_module_is_over_the_limit():
    problems = modules_over_the_limit()
    assert not problems, "\n".join(problems)


def test_a_module_over_the_limit_is_named(tmp_path, monkeypatch):
    """The check fails on a deliberately grown module, whatever its docstring says."""
    copy_packages(tmp_path)
    grown = tmp_path / "zerosim" / "values" / "layout.py"
    grown.write_text(f'"""{WHY_ONE_MODULE} none."""\n' + grown.read_text() + "\n" * MAX_MODULE_LINES)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert [p.split(" has ")[0] for p in modules_over_the_limit()] == ["zerosim.values.layout"]


if __name__ == "__main__":
    _write_picture()
