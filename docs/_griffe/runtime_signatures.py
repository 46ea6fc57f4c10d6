"""A griffe extension for the API reference: show the constructor signatures that classes build at run time.

``distoptim.functional``'s optimizers take ``torch.optim``'s hyperparameters with its defaults; their ``__init__``
is the generic ``(params, *args, **kwargs)`` and the real signature is the class's ``__signature__``, made from a
table when the module is imported. Static analysis cannot see it, so this extension imports each distoptim class
that sets one and gives griffe an ``__init__`` with that signature (private parameters left out) to render.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import griffe

SRC = str(Path(__file__).resolve().parents[2] / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)  # import this checkout's distoptim, as the static analysis reads it (mkdocs.yml: paths)

KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


class RuntimeSignatures(griffe.Extension):
    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if not cls.path.startswith("distoptim."):
            return
        runtime = getattr(importlib.import_module(cls.module.path), cls.name, None)
        signature = vars(runtime).get("__signature__") if isinstance(runtime, type) else None
        if not isinstance(signature, inspect.Signature):
            return
        parameters = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
        for parameter in signature.parameters.values():
            if parameter.name.startswith("_"):
                continue
            annotation = None if parameter.annotation is inspect.Parameter.empty else str(parameter.annotation)
            default = None if parameter.default is inspect.Parameter.empty else repr(parameter.default)
            kind = KINDS[parameter.kind]
            parameters.append(griffe.Parameter(parameter.name, annotation=annotation, kind=kind, default=default))
        cls.set_member("__init__", griffe.Function("__init__", parameters=griffe.Parameters(*parameters)))
