"""Importing this module registers every op lowering in `registry.LOWERINGS`."""
from . import pointwise, pool, reduce, views  # noqa: F401
from . import scatter  # noqa: F401  (after views: it replaces some of its lowerings)
