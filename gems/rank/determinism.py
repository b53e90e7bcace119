"""``train.deterministic``: the ops torch ran without a deterministic kernel (it has none for them), named in the
record, so that "the same bits" is promised only where it holds."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

#: how torch says an op ran without a deterministic kernel under ``use_deterministic_algorithms(True, warn_only=True)``
ALERT = " does not have a deterministic implementation, but you set 'torch.use_deterministic_algorithms(True"


@contextlib.contextmanager
def nondeterministic_ops(seen: set[str]) -> Iterator[None]:
    """Around a run with ``train.deterministic``: the op of every alert torch raises is added to ``seen`` (nothing
    kept but the ops' names); any other warning is shown as it would have been."""
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = str(message)
        if ALERT in text:
            seen.add(text.split(ALERT)[0].strip())
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def note(seen: set[str]) -> str | None:
    """The record's note on the ops that ran without a deterministic kernel (None where every one had one)."""
    if not seen:
        return None
    ops = sorted(seen)
    return (f"train.deterministic: {len(ops)} op(s) ran without a deterministic kernel (torch has none for them), so "
            f"two runs may differ in their last bits: {', '.join(ops)}")
