"""kvports: one decoder-only transformer in PyTorch, JAX/Flax and NumPy, token-equal.

Installed, everything lives under this one name (`kvports.shared`, `kvports.torch_impl`,
`kvports.jax_impl`, `kvports.numpy_impl`, `kvports.baselines`), so nothing collides with
another project's `shared`. In the repository those folders sit beside this one.
"""

import os as _os

__version__ = "0.1.0"

# In a checkout (run from the repository, or installed editable), the subpackages are the
# top-level folders beside this one; an installed wheel has them inside this folder.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "shared", "__init__.py")) and _checkout not in __path__:
    __path__.append(_checkout)
