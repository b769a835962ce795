"""Rotor (Pence et al.): attention projections as Clifford-algebra rotor sandwiches.

- `decomposition`: the algebra Cl(n, 0) in plain torch (products, simple rotors, the invariant decomposition);
- `layer`: `RotorLinear`, the factored linear a checkpoint stores;
- `method`: the ``method="rotor"`` replacer (trained against the dense projections).
"""

from .layer import RotorLinear
from .method import Rotor

__all__ = ["Rotor", "RotorLinear"]
