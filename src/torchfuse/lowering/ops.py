"""Importing this module registers every op lowering in `lowering.LOWERINGS`."""
from . import pointwise as lower_pointwise, pool as lower_pool, reduce as lower_reduce, views as lower_views  # noqa: F401
