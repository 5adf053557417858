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
    count and the ``input_ids`` of ``DIGEST_ROWS`` rows spread over them. Data reordered,
    replaced or edited in the rows read changes it (an edit elsewhere of the same length is not
    seen); the same content copied elsewhere (a new modification time) does not. None where the
    rows have no length or no ``input_ids``, or cannot be read."""
    try:
        n = len(rows)
        h = hashlib.blake2b(str(n).encode(), digest_size=16)
        for i in sorted({(n - 1) * k // max(DIGEST_ROWS - 1, 1) for k in range(DIGEST_ROWS)}):
            if n:
                h.update(np.asarray(rows[i]["input_ids"], dtype=np.int64).tobytes())
    except Exception:  # noqa: BLE001 - any dataset: no identity, never a failed run
        return None
    return h.hexdigest()


def rows_identity(rows: Any) -> str:
    """What the data-parallel ranks compare of their train rows: ``rows_digest`` of rows whose
    reads are deterministic (a ``datasets.Dataset``, a list), else their count (a dataset of
    one's own may draw at random per read); "stream" for a stream. Never raises: a rank that
    failed here would leave the others waiting in the collective."""
    import torch  # noqa: PLC0415

    if rows is None:
        return "none"
    if isinstance(rows, torch.utils.data.IterableDataset):
        return "stream"
    if isinstance(rows, (list, tuple)) or type(rows).__module__.split(".")[0] == "datasets":
        return f"digest {rows_digest(rows)}"
    try:
        return f"{len(rows)} rows"
    except Exception:  # noqa: BLE001 - no length
        return "unsized"
