"""Old import paths of the tooling that moved to :mod:`sfi_vllm.tools`.

``sfi_vllm.model_prep``, ``sfi_vllm.cli``, ``sfi_vllm.batch`` and the rest of the tooling now live
under ``sfi_vllm.tools``. Code written against the old paths (``from sfi_vllm.model_prep import
prepare_model``, ``python -m sfi_vllm.cli demo``) keeps working through this finder: importing an
old name gives the module at its new place (the same module object) with a DeprecationWarning.
The finder imports nothing until an old name is asked for, so the runtime still never loads the
tooling.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = ("batch", "cli", "config_table", "demo", "engine_job", "model_prep", "policies", "quality",
         "request_flow", "texts")


class _AliasLoader(importlib.abc.Loader):
    """Binds the old name to the module at its new place. ``create_module`` leaves Python a
    placeholder (which gets the alias spec); ``exec_module`` puts the real module in its place in
    ``sys.modules``, which is what the import returns, so the real module keeps its own spec."""

    def __init__(self, old_name: str, new_name: str) -> None:
        self.old_name, self.new_name = old_name, new_name

    def create_module(self, spec):
        return None  # a plain placeholder module

    def exec_module(self, module) -> None:
        warnings.warn(f"{self.old_name} moved to {self.new_name}", DeprecationWarning, stacklevel=2)
        sys.modules[self.old_name] = importlib.import_module(self.new_name)

    def get_code(self, fullname: str):
        """``python -m <old name>`` (runpy): the code of the module at its new place."""
        warnings.warn(f"{self.old_name} moved to {self.new_name}", DeprecationWarning, stacklevel=2)
        spec = importlib.util.find_spec(self.new_name)
        if spec is None or spec.loader is None or isinstance(spec.loader, _AliasLoader):
            raise ImportError(f"no code for {self.new_name}")
        return spec.loader.get_code(self.new_name)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != "sfi_vllm" or parts[1] not in MOVED:
            return None
        new_name = "sfi_vllm.tools." + ".".join(parts[1:])
        spec = importlib.util.find_spec(new_name)
        if spec is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname, new_name),
                                               is_package=spec.submodule_search_locations is not None)


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())  # before the path finder: submodules of a moved package too
