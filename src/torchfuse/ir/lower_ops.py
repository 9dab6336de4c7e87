"""Importing this module registers every op lowering in `lowering.LOWERINGS`."""
from . import lower_pointwise, lower_pool, lower_reduce, lower_views  # noqa: F401
