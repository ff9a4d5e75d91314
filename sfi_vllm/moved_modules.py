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
    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new_name}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new_name)

    def exec_module(self, module) -> None:  # the module ran at its new place
        pass

    def get_code(self, fullname: str):  # ``python -m <old name>`` (runpy) runs the new module's code
        return importlib.util.find_spec(self.new_name).loader.get_code(self.new_name)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != "sfi_vllm" or parts[1] not in MOVED:
            return None
        new_name = "sfi_vllm.tools." + ".".join(parts[1:])
        spec = importlib.util.find_spec(new_name)
        if spec is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new_name),
                                               is_package=spec.submodule_search_locations is not None)


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())  # before the path finder: submodules of a moved package too
