"""The dtypes a model runs in, named once (configs, the command line and the runners read this)."""

from typing import Literal, get_args

DType = Literal["float32", "bfloat16"]
DTYPE_NAMES: tuple[str, ...] = get_args(DType)
