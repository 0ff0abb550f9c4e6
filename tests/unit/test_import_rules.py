"""The dependency rule of ARCHITECTURE.md, checked over every import statement (function-local ones included):

- ``backend`` runs headless and in the detached ranks: it never imports the launcher, the nodes, or ComfyUI's
  server side (``server``, ``execution``, ``comfy_api``, ``aiohttp``);
- ``launcher`` owns processes and routes: it never imports the nodes, and from the backend only its launcher
  façade (``LAUNCHER_FACADE``);
- ``nodes`` are forms: from the backend they import only its façade (``NODE_FACADE``);
- only ``backend/host/runtime.py`` changes ``sys.path``;
- our own modules import each other relatively (ComfyUI imports the extension under a module name made of its
  folder's path, so ``pipetrain.`` is not its name there).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("backend", "launcher", "nodes")
SERVER_SIDE = ("server", "execution", "comfy_api", "comfy_execution", "aiohttp")
# what a node may import from the backend: config and its run patches, preflight checks, errors, and the
# model-type facts the Model node shows (registry, file detection, parity verdict), and the writer of datasets
# made in the graph (Images To Dataset)
NODE_FACADE = ("backend.config", "backend.preflight", "backend.errors", "backend.config.schema", "backend.parity.check",
               "backend.models.registry", "backend.models.loading", "backend.data.graph_dataset")
# what the launcher (in the ComfyUI process) may import from the backend: config and run folders, the commands and
# environments of the processes it starts, the checks it runs before starting one, and the sample files it serves
LAUNCHER_FACADE = ("backend.config", "backend.errors", "backend.config.schema", "backend.preflight", "backend.run.folder",
                   "backend.run.control", "backend.process.command_lines", "backend.process.deepspeed_cli", "backend.process.cluster",
                   "backend.parity.fallback", "backend.fsutil", "backend.data", "backend.models.registry", "backend.optim.registry",
                   "backend.memory.plan", "backend.memory.cli", "backend.memory.plan_config",
                   "backend.sampling.render", "backend.sampling.host_render", "backend.sampling.audio", "backend.sampling.clips")


def _modules():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            yield path, ".".join(path.relative_to(REPO).with_suffix("").parts)


def _imports(path: Path, module: str):
    """(line, name) of each import: our own modules (relative imports) as ``.backend.config`` etc., others
    (ComfyUI's ``nodes``, torch, ...) as written; ``from m import x`` as ``m.x``, since x may be a module."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = "." + ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, f"{base.rstrip('.')}.{alias.name}"


def _violations(rule) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line} imports {name}"
            for path, module in _modules() for line, name in _imports(path, module) if rule(module, name)]


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _ours(packages) -> tuple[str, ...]:
    return tuple("." + p for p in packages)


def test_the_backend_imports_neither_the_launcher_nor_the_nodes_nor_the_server():
    assert _violations(lambda module, name: module.startswith("backend.")
                       and _within(name, (*_ours(("launcher", "nodes")), *SERVER_SIDE))) == []


def test_the_launcher_never_imports_the_nodes():
    assert _violations(lambda module, name: module.startswith("launcher.") and _within(name, _ours(("nodes",)))) == []


def test_the_launcher_imports_only_the_backends_launcher_facade():
    assert _violations(lambda module, name: module.startswith("launcher.") and _within(name, _ours(("backend",)))
                       and not _within(name, _ours(LAUNCHER_FACADE))) == []


def test_nodes_import_only_the_backends_facade():
    assert _violations(lambda module, name: module.startswith("nodes.") and _within(name, _ours(("backend",)))
                       and not _within(name, _ours(NODE_FACADE))) == []


def test_our_modules_import_each_other_relatively():
    assert _violations(lambda module, name: _within(name, ("pipetrain",))) == []


def test_only_the_runtime_module_changes_sys_path():
    found = []
    for path, module in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else (
                node.targets[0] if isinstance(node, ast.Assign) else None)
            if (isinstance(target, ast.Attribute) and target.attr == "path"
                    and isinstance(target.value, ast.Name) and target.value.id == "sys"):
                found.append(module)
    assert sorted(set(found)) == ["backend.host.runtime"]


def test_every_torch_load_is_restricted_to_tensors_and_plain_values():
    """A file PipeTrain unpickles may have been planted (a run folder, a cache, a model folder): each ``torch.load``
    says ``weights_only=True`` itself (torch's default has changed before), and nothing calls ``pickle.load``."""
    found = []
    for folder in (*PACKAGES, "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
                restricted = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                                 for k in node.keywords)
                if (owner, node.func.attr) in (("pickle", "load"), ("pickle", "loads")) or (
                        (owner, node.func.attr) == ("torch", "load") and not restricted):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


@pytest.mark.parametrize("source, module, expected", [
    ("from ..launcher.core import x", "backend.train.loop", ".backend.launcher.core.x"),
    ("from ...launcher import core", "backend.train.loop", ".launcher.core"),
    ("from . import lora", "backend.train.loop", ".backend.train.lora"),
    ("import server", "backend.parity.verify", "server"),
    ("from nodes import NODE_CLASS_MAPPINGS", "launcher.comfy", "nodes.NODE_CLASS_MAPPINGS"),
])
def test_the_checker_resolves_relative_imports(tmp_path, source, module, expected):
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    assert [name for _, name in _imports(path, module)] == [expected]


# what ComfyUI itself provides to a custom node (its own modules and its server's library)
# torchaudio: in ComfyUI's requirements (its ACE-Step VAE needs it); declaring it here would have pip pull the torch
# its release pins, so scripts/setup.sh installs it without dependencies
# comfy_kitchen: the fused kernels of ComfyUI 0.8 on, imported only where that ComfyUI already imported it
HOST_PROVIDED = {"comfy", "comfy_api", "comfy_execution", "comfy_extras", "execution", "folder_paths", "nodes",
                 "server", "aiohttp", "torchaudio", "comfy_kitchen"}
IMPORT_NAMES = {"pillow": "PIL", "tomli-w": "tomli_w", "pytorch-optimizer": "pytorch_optimizer",
                "torch-optimi": "optimi"}   # distributions whose import name differs


def _declared() -> dict[str, str]:
    """import name -> distribution, from pyproject.toml's dependencies."""
    import re
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # optional dependencies (extras) count: the code imports them only where a config asks for them
    extras = {k: v for k, v in project.get("optional-dependencies", {}).items() if k != "test"}
    deps = project["dependencies"] + [d for extra in extras.values() for d in extra]
    names = {re.split(r"[<>=;\s\[]", d, maxsplit=1)[0].lower() for d in deps}
    return {IMPORT_NAMES.get(n, n.replace("-", "_")): n for n in names}


def test_every_library_the_code_imports_is_declared_and_every_declared_one_is_used():
    import sys
    imported = set()
    for path, module in _modules():
        imported |= {name.split(".")[0] for _, name in _imports(path, module) if not name.startswith(".")}
    third_party = imported - set(sys.stdlib_module_names) - HOST_PROVIDED
    declared = _declared()
    assert sorted(third_party - set(declared)) == []
    code = "\n".join(path.read_text() for path, _ in _modules())
    # a library may be imported by name at run time (an optimizer registry, torch's tensorboard writer)
    assert sorted(name for name in declared if name not in third_party and name not in code) == []


def test_every_package_folder_is_packaged():
    import tomllib
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(("pipetrain", *init.parent.relative_to(REPO).parts))
               for package in PACKAGES for init in (REPO / package).rglob("__init__.py")}
    assert sorted(folders - listed) == []
