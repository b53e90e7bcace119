"""``train.deterministic``: the ops torch ran without a deterministic kernel (it has none for them), named in the
record, so that "the same bits" is promised only where it holds."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

#: how torch says an op ran without a deterministic kernel under ``use_deterministic_algorithms(True, warn_only=True)``
ALERT = " does not have a deterministic implementation, but you set 'torch.use_deterministic_algorithms(True"


@contextlib.contextmanager
def nondeterministic_ops(seen: set[str]) -> Iterator[None]:
    """Around a run with ``train.deterministic``: the op of every alert torch raises is added to ``seen``; any other
    warning is shown as it would have been (after the run)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            others = []
            for w in caught:
                text = str(w.message)
                if ALERT in text:
                    seen.add(text.split(ALERT)[0].strip())
                else:
                    others.append(w)
    for w in others:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def note(seen: set[str]) -> str | None:
    """The record's note on the ops that ran without a deterministic kernel (None where every one had one)."""
    if not seen:
        return None
    ops = sorted(seen)
    return (f"train.deterministic: {len(ops)} op(s) ran without a deterministic kernel (torch has none for them), so "
            f"two runs may differ in their last bits: {', '.join(ops)}")
