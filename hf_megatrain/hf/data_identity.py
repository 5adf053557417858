"""The identity of a run's train rows, compared where two must be the same: a resumed run's and
its checkpoint's (``cli_resume.check_same_rows``), every data-parallel rank's
(``trainer.check_same_on_every_rank``)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

#: Rows read for ``rows_digest``, spread evenly over the data (milliseconds at any size).
DIGEST_ROWS = 64


def rows_digest(rows: Any) -> str | None:
    """The identity of map-style train rows (a ``datasets.Dataset`` or a list of dicts): their
    count and the ``input_ids`` of ``DIGEST_ROWS`` rows spread over them. Files edited,
    reordered or replaced change it; the same content copied elsewhere (a new modification
    time) does not. None where the rows have no length or no ``input_ids``."""
    try:
        n = len(rows)
        h = hashlib.blake2b(str(n).encode(), digest_size=16)
        for i in sorted({(n - 1) * k // max(DIGEST_ROWS - 1, 1) for k in range(DIGEST_ROWS)}):
            if n:
                h.update(np.asarray(rows[i]["input_ids"], dtype=np.int64).tobytes())
    except (TypeError, KeyError, IndexError, ValueError):
        return None
    return h.hexdigest()
