"""Optional dependencies: import one, or fail with one line that names the extra to install.

The base install is what a service needs (the client, the worker, the learner). The rest
comes in extras (see ``pyproject.toml``):

- ``cli``: rich, for the operator views (``status``, ``label``, ``evaluate``);
- ``text``: the MiniLM encoder for the text flavour of the simulator;
- ``lm``: transformers and gguf, for the evaluator's local causal LM;
- ``ui``: starlette, jinja2, uvicorn, python-multipart and itsdangerous, for ``causalmem ui``;
- ``langchain`` / ``llamaindex``: langchain-core / llama-index-core, for the adapters
  (``pipeline.client.langchain``, ``pipeline.client.llamaindex``).

``make demo`` and ``make test`` install every extra, and the lab (``lab/``, its own distribution,
which adds ``demo`` and ``bench``).

>>> require("json", "cli").dumps([1])
'[1]'
>>> require("not_here", "cli")
Traceback (most recent call last):
...
pipeline.extras.MissingExtra: this needs not_here, from the 'cli' extra: pip install 'causal-memory-pipeline[cli]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

DIST = "causal-memory-pipeline"


class MissingExtra(RuntimeError):
    """An optional dependency is not installed; the message says which extra brings it."""


def message(module: str, extra: str) -> str:
    return f"this needs {module.split('.')[0]}, from the '{extra}' extra: pip install '{DIST}[{extra}]'"


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``; raise :class:`MissingExtra` (a ``RuntimeError``) naming ``extra`` when it is missing.

    The CLI prints a ``RuntimeError`` as one line (``causalmem VERB: ...``) and exits 1.
    Only a missing top-level package counts: an ``ImportError`` from inside an installed
    package propagates as it is.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing or not (module == missing or module.startswith(missing + ".")):
            raise
        raise MissingExtra(message(module, extra)) from exc
