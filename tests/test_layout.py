"""The arrows of docs/design.md ("Layout of the code"), read from the source: integrations ->
core -> the dispatch module -> kernels, never back; and no circle among the core's modules,
function-level imports included."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, relative ones resolved inside their
    package (``kernels/`` is installed as ``onebit_plugin.kernels``)."""
    package = {"kernels": "onebit_plugin.kernels", "integrations": "onebit_plugin.integrations",
               "onebit_plugin": "onebit_plugin"}[path.relative_to(ROOT).parts[0]]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join([package, *filter(None, [module])])
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_kernels_import_nothing_of_the_core():
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for line, module in _imports(path):
            assert not module.startswith("onebit_plugin.") or \
                module.startswith("onebit_plugin.kernels"), f"{path.name}:{line} imports {module}"


def test_only_the_dispatch_module_reaches_the_kernels():
    for path in sorted((ROOT / "onebit_plugin").rglob("*.py")):
        for line, module in _imports(path):
            if module.startswith("onebit_plugin.kernels"):
                assert path.name == "dispatch.py", f"{path.name}:{line} imports {module}"


def test_the_core_imports_the_integrations_once_to_register_the_strategies():
    seen = [(path.name, line, module)
            for path in sorted((ROOT / "onebit_plugin").rglob("*.py"))
            for line, module in _imports(path) if module.startswith("onebit_plugin.integrations")]
    assert [(name, module) for name, _, module in seen] == [
        ("__init__.py", "onebit_plugin.integrations.lightning.register_when_imported")]


# What an integration may import from below the package's top level: the two readers that run
# before torch is wanted (onebit-run's --help and the autoload hook on every interpreter start),
# from settings modules that import no torch.
LIGHT_IMPORTS = {"onebit_plugin.settings.config.flag", "onebit_plugin.settings.registry.MEMBERS"}


def test_integrations_use_the_cores_public_names():
    """An integration imports the core's names from ``onebit_plugin`` itself (its ``__all__``),
    but for ``LIGHT_IMPORTS``, and nothing private."""
    import onebit_plugin

    for path in sorted((ROOT / "integrations").rglob("*.py")):
        for line, module in _imports(path):
            parent, _, name = module.rpartition(".")
            if not parent.startswith("onebit_plugin") or \
                    parent.startswith("onebit_plugin.integrations"):
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if parent == "onebit_plugin":
                assert name in onebit_plugin.__all__, where
            else:
                assert module in LIGHT_IMPORTS, where


def _core_module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _core_arrows() -> dict[str, set[str]]:
    """Core module -> the core modules it imports, anywhere in it (a function-level import
    too); ``from package import name`` counts as the module ``package.name`` when that is one.
    The package's ``__init__`` (which imports every public name) is left out: nothing in the
    core imports it."""
    paths = {_core_module(p): p for p in (ROOT / "onebit_plugin").rglob("*.py")}
    core = set(paths) - {"onebit_plugin"}
    arrows = {}
    for name in core:
        arrows[name] = set()
        for _, module in _imports(paths[name]):
            for target in (module, module.rpartition(".")[0]):
                if target in core and target != name:
                    arrows[name].add(target)
                    break
    return arrows


def test_no_import_circle_in_the_core():
    arrows = _core_arrows()
    assert "onebit_plugin.core.base" in arrows and arrows["onebit_plugin.core.base"]
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(name):] +
                                                                 [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(arrows[name]):
            visit(target)
        path.pop()
        done.add(name)

    for name in sorted(arrows):
        visit(name)


# The core's layers, bottom first: a module imports only from its own layer or one below
# (docs/design.md, "Layout of the code"); comm and maths, side by side, not from each other.
LAYERS = {"settings": 0, "wire": 1, "comm": 2, "maths": 2, "core": 3, "members": 4, "entry": 5}


def test_the_cores_layers_import_downwards_only():
    arrows = _core_arrows()
    packages = {name.split(".")[1] for name in arrows if name.count(".") >= 1}
    assert packages == set(LAYERS), packages  # every module in a layer, every layer present
    for source, targets in arrows.items():
        layer = source.split(".")[1]
        for target in targets:
            other = target.split(".")[1]
            assert LAYERS[other] < LAYERS[layer] or other == layer, f"{source} imports {target}"


def test_no_folder_of_the_core_holds_more_than_15_modules_nor_a_module_450_lines():
    for folder in [ROOT / "onebit_plugin", *(ROOT / "onebit_plugin" / name for name in LAYERS)]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 15, f"{folder.name}: {len(modules)} modules"
        for path in modules:
            lines = len(path.read_text().splitlines())
            assert lines <= 450, f"{path.relative_to(ROOT)}: {lines} lines"
