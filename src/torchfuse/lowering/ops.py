"""Importing this module registers every op lowering in `registry.LOWERINGS`."""
from . import pointwise, pool, reduce, views  # noqa: F401
