"""kvports: one decoder-only transformer in PyTorch, JAX/Flax and NumPy, token-equal.

    import kvports
    model = kvports.load("numpy")          # or load("torch", "model.safetensors", device="gpu")
    model.generate([160, 248, 104, 209, 394], new_tokens=8).generated

This package is the application: the command line (`cli`, `commands/`), the run layer
(`loading`, `generating`, `validation`), the bench, continuous batching, the checker and the
file formats. The ports and what they share install under this one name too (`kvports.torch_impl`,
`kvports.jax_impl`, `kvports.numpy_impl`, `kvports.shared`), so nothing collides with another
project's `shared`; in the repository those folders sit beside this one.
"""

import os as _os
from typing import TYPE_CHECKING

from kvports.version import __version__

if TYPE_CHECKING:  # what __getattr__ below hands out, for type checkers and editors
    from kvports.api import Generation, GenerationConfig, Model, UserError, load

# In a checkout (run from the repository, or installed editable), the subpackages are the
# top-level folders beside this one; an installed wheel has them inside this folder.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "shared", "__init__.py")) and _checkout not in __path__:
    __path__.append(_checkout)

__all__ = ["Generation", "GenerationConfig", "Model", "UserError", "__version__", "load"]


def __getattr__(name: str) -> object:
    # The API (kvports.api) loads on first use: `import kvports.shared...` stays as light as shared itself.
    if name in ("Generation", "GenerationConfig", "Model", "UserError", "load"):
        from kvports import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvports' has no attribute {name!r}")
