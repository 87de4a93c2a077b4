"""The tests mirror the package: from a module of ``weightsync/`` its tests are found in one step
(read from the file tree; nothing is imported or run).

The rule, in each tier folder (``tests/unit/``: the fast tier; ``tests/integration/``: real vLLM,
Ray, processes):

- ``<tier>/<package>/test_<name>.py`` tests the subpackage ``weightsync/<package>/`` (the folder is
  named exactly like it, ``_runtime`` included), and ``<name>`` starts with the package's name or
  the name of one of its modules, a leading ``_`` dropped: ``tests/unit/strategies/test_layout.py``
  tests ``weightsync/strategies/_layout.py``, ``tests/integration/servers/test_reward_server.py``
  tests ``weightsync/servers/reward.py``, ``tests/unit/clients/test_clients.py`` the package.
- ``<tier>/test_<name>.py`` (the tier's root) tests a top-level module ``weightsync/<module>.py``,
  ``<name>`` starting with the module's name (``test_engine_faults.py``: ``engine.py``), or, the
  few files in ``WHOLE_PACKAGE``, the package as a whole.
- ``tests/integration/examples/`` tests ``examples/`` (the runnable examples, outside the
  package); its files are named ``test_examples*.py``. ``tests/integration/docs/`` tests
  ``docs/`` and the README (their command lines, the quickstart); ``test_docs*.py``.
- A helper module (``_name.py``) sits next to the tests that use it, or at the tier root when
  tests of several folders share it (``tests/integration/_sharded_sync.py``; pytest's
  ``pythonpath`` puts ``tests/integration`` on ``sys.path``). ``conftest.py`` lives only in
  ``tests/`` and ``tests/integration/``: one session-scoped server of each kind for every
  integration subfolder.
- ``tests/gpu/`` groups by hardware (needs a CUDA GPU), not by package, and is not checked here.
- Every module basename under ``tests/`` is unique (there is no ``__init__.py`` in ``tests/``, so
  pytest imports a test file by its basename).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
TIERS = ("tests/unit", "tests/integration")
CONFTESTS = {"tests/conftest.py", "tests/integration/conftest.py"}
# tier-root test files that test the package as a whole, not one module -> what they test
WHOLE_PACKAGE = {
    "test_import_graph.py": "the import graph of every module of weightsync/",
    "test_import_light.py": "what `import weightsync` loads",
    "test_tests_layout.py": "this rule, over tests/",
    "test_wheel.py": "the wheel built from the checkout",
}
# tier subfolders that mirror a folder outside weightsync/ -> the names their files start with
OUTSIDE_PACKAGE = {"examples": ("examples",), "docs": ("docs",)}


def _bare(name: str) -> str:
    return name[1:] if name.startswith("_") and not name.startswith("__") else name


def package_layout(root: Path) -> dict[str, tuple[str, ...]]:
    """Subpackage -> the names a test of it may start with ("" is the top level: its modules)."""
    pkg = root / "weightsync"
    out = {"": tuple(sorted(_bare(p.stem) for p in pkg.glob("*.py") if p.stem != "__init__"))}
    for sub in sorted(p.parent for p in pkg.glob("*/__init__.py")):
        out[sub.name] = (_bare(sub.name), *sorted(
            _bare(p.stem) for p in sub.glob("*.py") if p.stem not in ("__init__", "__main__")))
    return out


def _named_after(stem: str, names: tuple[str, ...]) -> bool:
    subject = stem.removeprefix("test_")
    return any(subject == n or subject.startswith(n + "_") for n in names)


def misplaced(files: list[str], layout: dict[str, tuple[str, ...]]) -> list[str]:
    """Every file of ``files`` (paths under ``tests/``, posix) that breaks the rule, and why."""
    out = []
    for rel in files:
        path = PurePosixPath(rel)
        if rel in CONFTESTS or path.parts[1] == "gpu":
            continue
        if path.name == "conftest.py":
            out.append(f"{rel}: conftest.py only as {sorted(CONFTESTS)}")
            continue
        tier = "/".join(path.parts[:2])
        if tier not in TIERS or len(path.parts) == 2:
            out.append(f"{rel}: tests live in one of {TIERS} or tests/gpu")
            continue
        inner = path.parts[2:]
        if len(inner) > 2:
            out.append(f"{rel}: one folder level per tier (weightsync/ has no deeper packages)")
            continue
        if path.name.startswith("_"):  # a helper: anywhere a test may be
            folder = inner[0] if len(inner) == 2 else ""
            if folder and folder not in layout and folder not in OUTSIDE_PACKAGE:
                out.append(f"{rel}: no package weightsync/{folder}/ to mirror")
            continue
        if not path.name.startswith("test_"):
            out.append(f"{rel}: a test module is named test_*.py, a helper _*.py")
            continue
        if len(inner) == 1:
            if path.name not in WHOLE_PACKAGE and not _named_after(path.stem, layout[""]):
                out.append(f"{rel}: at the tier root a test is named after a top-level module "
                           f"of weightsync/ (test_<module>[_what].py, one of {list(layout[''])}) "
                           f"or listed in WHOLE_PACKAGE; a test of a subpackage goes in its "
                           f"folder")
            continue
        folder = inner[0]
        names = layout.get(folder) or OUTSIDE_PACKAGE.get(folder)
        if names is None:
            out.append(f"{rel}: no package weightsync/{folder}/ to mirror (folders: "
                       f"{sorted(k for k in layout if k)} and {sorted(OUTSIDE_PACKAGE)})")
        elif not _named_after(path.stem, names):
            out.append(f"{rel}: a test in {folder}/ is named after the package or one of its "
                       f"modules (test_<name>[_what].py, <name> one of {list(names)})")
    return out


def duplicate_basenames(files: list[str]) -> list[str]:
    seen: dict[str, list[str]] = {}
    for rel in files:
        seen.setdefault(PurePosixPath(rel).name, []).append(rel)
    return [f"{name}: {paths}" for name, paths in sorted(seen.items())
            if len(paths) > 1 and name != "conftest.py"]


def _test_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*.py"))


def test_every_test_file_sits_where_its_package_is() -> None:
    files = _test_files()
    assert len(files) > 50 and "tests/unit/test_tests_layout.py" in files
    bad = misplaced(files, package_layout(ROOT))
    assert not bad, "tests that do not mirror the package:\n  " + "\n  ".join(bad)


def test_module_basenames_are_unique() -> None:
    dups = duplicate_basenames(_test_files())
    assert not dups, "two test modules of one name (pytest imports by basename):\n  " + \
        "\n  ".join(dups)


def test_the_rule_catches_what_it_forbids() -> None:
    layout = {"": ("engine", "types"), "strategies": ("strategies", "layout", "broadcast"),
              "_runtime": ("runtime", "shm")}
    good = ["tests/unit/test_engine.py", "tests/unit/test_engine_faults.py",
            "tests/unit/strategies/test_layout.py", "tests/unit/strategies/test_strategies_x.py",
            "tests/integration/_runtime/test_shm.py", "tests/integration/_helper.py",
            "tests/integration/examples/test_examples.py", "tests/unit/test_wheel.py",
            "tests/integration/conftest.py", "tests/gpu/test_anything.py"]
    assert misplaced(good, layout) == []
    bad = ["tests/unit/test_layout.py",  # a subpackage's test at the root
           "tests/unit/strategies/test_engine.py",  # a top-level module's test in a subfolder
           "tests/unit/strategies/test_layouts.py",  # no module `layouts`
           "tests/unit/clients/test_clients.py",  # no package clients
           "tests/unit/strategies/deep/test_layout.py", "tests/test_types.py",
           "tests/unit/strategies/conftest.py", "tests/unit/strategies/check_layout.py"]
    assert [m.split(":")[0] for m in misplaced(bad, layout)] == bad
    assert duplicate_basenames(["tests/unit/a/test_x.py", "tests/integration/b/test_x.py",
                                "tests/conftest.py", "tests/integration/conftest.py"]) == [
        "test_x.py: ['tests/unit/a/test_x.py', 'tests/integration/b/test_x.py']"]
    real = package_layout(ROOT)
    assert "layout" in real["strategies"] and "runtime" in real["_runtime"]
    assert "engine" in real[""] and "__init__" not in real[""]
