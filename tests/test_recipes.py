"""Recipes: the user recipes in ``recipes/`` (few, each described, each accepted by the CLI) and the benchmark
inputs in ``benchmarks/recipes/<script>/``; every recipe path the repository names resolves to a file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
USER = ROOT / "recipes"
BENCH = ROOT / "benchmarks" / "recipes"
MAX_USER_RECIPES = 15

# a path ending in .../recipes/<something>.json, as prose, code or JSON text writes it
_PATH = re.compile(r"(?<![\w.-])((?:[\w.-]+/)*recipes/[\w./-]*?\.json)")


def _scanned() -> list[Path]:
    """The files whose text may name a recipe: the READMEs, docs, changelog, benchmarks, package and tests."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for folder, patterns in (("docs", ("*.md",)), ("benchmarks", ("*.py", "*.md", "*.json")),
                             ("hf_tensorcomp", ("*.py", "*.md")), ("tests", ("*.py",)), ("recipes", ("*.json",))):
        for pattern in patterns:
            files += sorted((ROOT / folder).rglob(pattern))
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]


def _named() -> list[tuple[Path, str]]:
    return [(f, m) for f in _scanned() for m in _PATH.findall(f.read_text(encoding="utf-8", errors="replace"))]


def test_every_named_recipe_path_resolves():
    named = _named()
    assert len(named) > 10, "the scan found almost no recipe paths: the pattern or the file list is broken"
    missing = sorted({f"{f.relative_to(ROOT)}: {p}" for f, p in named
                      if not ((ROOT / p).is_file() or (f.parent / p).is_file())})
    assert not missing, "recipe paths that name no file:\n" + "\n".join(missing)


def test_user_recipes_few_and_described():
    recipes = sorted(USER.glob("*.json"))
    assert 0 < len(recipes) <= MAX_USER_RECIPES, f"{len(recipes)} user recipes; allowed: 1 to {MAX_USER_RECIPES} " \
        "(benchmark inputs go to benchmarks/recipes/<script>/)"
    assert sorted(p.name for p in USER.iterdir()) == [p.name for p in recipes], "recipes/ holds JSON recipes only"
    for path in recipes:
        recipe = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(recipe, dict), path.name
        desc = recipe.get("description")
        assert isinstance(desc, str) and desc.strip(), f"{path.name}: no description"


@pytest.mark.parametrize("path", sorted(USER.glob("*.json")), ids=lambda p: p.name)
def test_user_recipe_accepted_by_the_cli(path):
    """Each user recipe is a valid ``--recipe`` of one CLI command (unknown keys are refused there)."""
    from hf_tensorcomp import cli

    errors = []
    for command in ("compress", "sweep", "linearize"):
        argv = [command, "--recipe", str(path), "--out", "unused"]
        parser = cli.build_parser()
        try:
            cli._apply_recipe(parser, argv)
            parser.parse_args(argv)
        except (ValueError, SystemExit) as e:
            errors.append(f"{command}: {e}")
            continue
        return
    pytest.fail(f"{path.name}: no command accepts it: {errors}")


def test_benchmark_recipes_beside_their_script():
    folders = sorted(p for p in BENCH.iterdir() if p.is_dir())
    assert folders, "benchmarks/recipes/ holds no benchmark's inputs"
    assert not list(BENCH.glob("*.json")), "benchmark recipes go in benchmarks/recipes/<script>/"
    for folder in folders:
        assert (ROOT / "benchmarks" / f"{folder.name}.py").is_file(), f"benchmarks/recipes/{folder.name}/: no such script"
        for path in folder.glob("*.json"):
            assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict), path
    clash = {p.name for p in USER.glob("*.json")} & {p.name for p in BENCH.rglob("*.json")}
    assert not clash, f"the same name in recipes/ and benchmarks/recipes/: {sorted(clash)}"


def test_every_named_benchmark_run_is_cited():
    """A recipe file of named runs (``{"runs": {NAME: recipe}}``, e.g. ``benchmarks/recipes/heal/runs.json``): every
    run is named somewhere in the repository's text (``run `NAME` `` or ``--run NAME``), so none is orphaned."""
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in _scanned())
    files = [p for p in BENCH.rglob("*.json") if "runs" in json.loads(p.read_text(encoding="utf-8"))]
    assert files, "no recipe file of named runs under benchmarks/recipes/"
    orphans = sorted(f"{p.relative_to(ROOT)}: {name}" for p in files for name in json.loads(p.read_text())["runs"]
                     if f"run `{name}`" not in text and f"--run {name}" not in text)
    assert not orphans, "named runs cited nowhere:\n" + "\n".join(orphans)
