"""Labels, checked as the database's unitvisor.labels_are_valid checks them (sql/migrations/005_sql_api.sql):
a run's own tags (`--label`), a host's `[host] labels` and a run's `host_labels` (schema 033), so that a
typo is refused where it is written, naming what it is, instead of by the database later."""

from __future__ import annotations

import re

# A key as Kubernetes' label names: it survives being put in a URL or a metric label.
KEY_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?")
MAX_LABELS = 64
MAX_VALUE = 255


def label_problem(key: str, value: object) -> str | None:
    """Why the pair cannot be a label (None: it can). Names the key once it is valid, never the value."""
    if not KEY_RE.fullmatch(key):
        return (f"{key!r} is not a label key (1 to 63 letters, digits, '.', '_', '-' and '/', "
                "starting and ending with a letter or digit)")
    if not isinstance(value, str):
        return f"the value of label {key} is not a string"
    if len(value) > MAX_VALUE or any(ord(c) < 32 or ord(c) == 127 for c in value):
        return f"the value of label {key} is over {MAX_VALUE} characters or has a control character"
    return None


def count_problem(labels: dict[str, object]) -> str | None:
    """Why the mapping has too many pairs to be a set of labels (None: it has not)."""
    return f"{len(labels)} labels, over the limit of {MAX_LABELS}" if len(labels) > MAX_LABELS else None


def labels_problem(labels: dict[str, object]) -> str | None:
    """Why the mapping cannot be a set of labels (None: it can): too many, or the first bad pair."""
    return count_problem(labels) or next((p for p in (label_problem(k, v) for k, v in labels.items()) if p), None)
