"""The ``bfloat16`` Zarr v3 data type, registered under the ``zarr.data_type`` entry point.

zarr-python 3.1 has no bfloat16. This ZDType (named ``"bfloat16"`` as in the zarr-extensions
registry, which tensorstore also reads natively) maps it to ``ml_dtypes.bfloat16``, so plain
zarr-python and xarray read dstt runs without importing dstt: the entry point imports only this
module (``dstt/__init__`` is lazy and pulls in no torch). Rejected alternative: storing bf16 as
uint16 with an attribute — every reader would have to know the convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
from zarr.core.dtype.npy.float import BaseFloat

__all__ = ["BFloat16"]

_BF16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat):  # type: ignore[type-arg]
    """Zarr data type for ``ml_dtypes.bfloat16`` (2 bytes, little-endian on disk)."""

    dtype_cls = type(_BF16)
    _zarr_v3_name = "bfloat16"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _check_native_dtype(cls, dtype: object) -> bool:  # type: ignore[override]
        return isinstance(dtype, np.dtype) and dtype == _BF16

    def to_native_dtype(self) -> np.dtype[Any]:
        return _BF16 if self.endianness != "big" else _BF16.newbyteorder(">")

    @property
    def item_size(self) -> int:
        return 2
