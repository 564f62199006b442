"""Tensor parallelism: DTensor leaves of stages, what the rest of fpipe may use.

Local pieces, placements as data for the wire, gradients with their parameters' placements, the
global norm's shares, and layouts to rebuild a DTensor around a piece (notes/tensor_parallel.md).
README.md says what the package owns and may import.
"""

from ._dtensor import DTensorHeader as DTensorHeader
from ._dtensor import DTensorLayout as DTensorLayout
from ._dtensor import check_mesh as check_mesh
from ._dtensor import clone as clone
from ._dtensor import dtensor_layout as dtensor_layout
from ._dtensor import from_header as from_header
from ._dtensor import header_of as header_of
from ._dtensor import is_dtensor as is_dtensor
from ._dtensor import like_param as like_param
from ._dtensor import local as local
from ._dtensor import mesh_ranks as mesh_ranks
from ._dtensor import on_ranks as on_ranks
from ._dtensor import placements_from as placements_from
from ._dtensor import shares_storage as shares_storage
from ._dtensor import square_sum as square_sum
from ._dtensor import with_piece as with_piece

__all__ = [
    "DTensorHeader",
    "DTensorLayout",
    "check_mesh",
    "clone",
    "dtensor_layout",
    "from_header",
    "header_of",
    "is_dtensor",
    "like_param",
    "local",
    "mesh_ranks",
    "on_ranks",
    "placements_from",
    "shares_storage",
    "square_sum",
]
