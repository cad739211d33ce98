"""Strict JSON for every ``--json`` output: NaN and Infinity (undefined rates, an absent link's
infinite transfer time) become null, which strict parsers accept, instead of bare tokens they reject."""

from __future__ import annotations

import json
import math
from typing import Any


def strict(obj: Any) -> Any:
    """``obj`` with every non-finite float (numpy scalars too) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if hasattr(obj, "item") and type(obj).__module__ == "numpy":
        return strict(obj.item())
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(strict(obj), allow_nan=False)
