"""Entry point: ``python -m pipetrain ...`` (installed) or ``python path/to/the/folder ...`` (a clone, e.g. in
ComfyUI's ``custom_nodes/`` under any folder name; every process PipeTrain starts runs this file by its path,
so it needs no installed ``pipetrain``)."""
if __package__:
    from .backend.cli import main
else:
    # Run by path: register this folder as the package ``pipetrain`` (by file location, so the copy beside this
    # file is the one used even where another one is installed).
    import importlib.util
    import sys
    from pathlib import Path

    _here = Path(__file__).resolve().parent
    _spec = importlib.util.spec_from_file_location("pipetrain", _here / "__init__.py",
                                                   submodule_search_locations=[str(_here)])
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["pipetrain"] = _package
    _spec.loader.exec_module(_package)
    from pipetrain.backend.cli import main

raise SystemExit(main())
