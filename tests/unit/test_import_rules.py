"""The dependency rule of ARCHITECTURE.md, checked over every import statement (function-local ones included);
``test_architecture_states_this_rule`` holds ARCHITECTURE.md to the constants below, word for word:

- ``backend`` runs headless and in the detached ranks: it never imports the launcher, the nodes, or ComfyUI's
  server side (``server``, ``execution``, ``comfy_api``, ``aiohttp``);
- inside ``backend``, each room (a folder, or one of the few modules at its root) imports only the rooms listed
  before it in ``ROOMS``, but for the function-local imports of ``UPWARD``;
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
# the backend's rooms, lowest first: a room imports only rooms before it (the modules at the root are rooms of one)
ROOMS = ("errors", "fsutil", "config", "host", "models", "adapters", "data", "cache", "optim", "run", "process",
         "memory", "parity", "sampling", "train", "preflight", "commands", "cli")
# the only imports of a later room, each inside a function: a fact the lower room reads when asked
UPWARD = (("backend.config.compat", "backend.models.registry"),      # which model type claims a file
          ("backend.config.model", "backend.models.registry"),       # which model types read a [model] key
          ("backend.config.compat_folders", "backend.models.registry"),  # which model types read a model folder
          ("backend.run.folder", "backend.train.checkpoint"),        # the checkpoint a resume starts from
          ("backend.memory.plan_config", "backend.train.preservation"))  # the rows of a preservation batch
# what a node may import from the backend: config and its run patches, preflight checks, errors, and the
# model-type facts the Model node shows (registry, file detection, parity verdict), and the writer of datasets
# made in the graph (Images To Dataset)
NODE_FACADE = ("backend.config", "backend.preflight", "backend.errors", "backend.parity.check",
               "backend.models.registry", "backend.models.loading", "backend.data.graph_dataset")
# what the launcher (in the ComfyUI process) may import from the backend: config and run folders, the commands and
# environments of the processes it starts, the checks it runs before starting one, and the sample files it serves
LAUNCHER_FACADE = ("backend.config", "backend.errors", "backend.fsutil", "backend.preflight", "backend.run",
                   "backend.data", "backend.memory", "backend.sampling", "backend.process.command_lines",
                   "backend.process.deepspeed_cli", "backend.process.cluster", "backend.parity.fallback",
                   "backend.models.registry", "backend.optim.registry")


def _modules():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            yield path, ".".join(path.relative_to(REPO).with_suffix("").parts)


def _imports(path: Path, module: str, local: bool = False):
    """(line, name) of each import: our own modules (relative imports) as ``.backend.config`` etc., others
    (ComfyUI's ``nodes``, torch, ...) as written; ``from m import x`` as ``m.x``, since x may be a module.
    With ``local``: (line, name, whether the import is inside a function)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(f)}
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = "." + ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found = [f"{base.rstrip('.')}.{alias.name}" for alias in node.names]
        for name in found:
            yield (node.lineno, name, id(node) in in_functions) if local else (node.lineno, name)


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


def _room(module: str) -> str | None:
    """The backend room of a module (``backend.train.loop``: ``train``; ``backend.cli``: ``cli``)."""
    parts = module.lstrip(".").split(".")
    return parts[1] if parts[0] == "backend" and len(parts) > 1 else None


def test_each_backend_room_imports_only_the_rooms_before_it():
    found = []
    for path, module in _modules():
        room = _room(module)
        if room is None:
            continue
        for line, name, local in _imports(path, module, local=True):
            target = _room(name) if name.startswith(".backend.") else None
            if target is None or target == room or ROOMS.index(target) < ROOMS.index(room):
                continue
            if not (local and any(module == m and _within(name[1:], (t,)) for m, t in UPWARD)):
                found.append(f"{path.relative_to(REPO)}:{line} ({room}) imports {name} ({target})")
    assert found == []


def test_every_room_is_ordered_and_every_upward_import_is_still_made():
    on_disk = {p.stem for p in (REPO / "backend").glob("*.py") if p.stem != "__init__"} | {
        p.parent.name for p in (REPO / "backend").glob("*/__init__.py")}
    assert sorted(on_disk) == sorted(ROOMS)
    made = {(module, name[1:]) for path, module in _modules() for _, name, local in _imports(path, module, local=True)
            if local and name.startswith(".backend.")}
    assert [(m, t) for m, t in UPWARD if not any(mm == m and _within(n, (t,)) for mm, n in made)] == []


def test_architecture_states_this_rule():
    """ARCHITECTURE.md names the rooms in this order, the upward imports and both façades, as this file does."""
    text = " ".join((REPO / "ARCHITECTURE.md").read_text().split())
    stated = [" → ".join(f"`{r}`" for r in ROOMS), *(f"`{m}` → `{t}`" for m, t in UPWARD),
              ", ".join(f"`{f}`" for f in NODE_FACADE), ", ".join(f"`{f}`" for f in LAUNCHER_FACADE),
              "Only `backend/host/runtime.py` changes `sys.path`"]
    assert [s for s in stated if s not in text] == []


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
