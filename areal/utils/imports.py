"""Objects named by import path ``module:name`` in a config (a user's reward or workflow)."""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def import_by_path(spec: str, field: str) -> Any:
    """The object ``module:name`` names; ValueError naming ``field``, the value and the fix when
    the form is wrong, the module does not import, or it has no such name."""
    if not IMPORT_PATH.fullmatch(spec):
        raise ValueError(f"{field}: {spec!r} is not an import path 'module:name'")
    module_name, name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = (e.name or "") if isinstance(e, ModuleNotFoundError) else ""
        if missing and missing != module_name and not module_name.startswith(missing + "."):
            raise ValueError(  # the module is there; something it imports is not
                f"{field}: {module_name!r} does not import in {sys.executable}: "
                f"ModuleNotFoundError: {e}; install the package that provides {missing!r} into "
                f"that interpreter ({sys.executable} -m pip install ...)"
            ) from None
        raise ValueError(
            f"{field}: cannot import {module_name!r} ({e}); put {module_name}.py beside "
            "the entry script or on PYTHONPATH"
        ) from None
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:10]
        raise ValueError(f"{field}: {module_name} has no {name!r} (found: {public})")
    return getattr(module, name)
