"""``slotfile diff``: where two slot files differ, in file order (headers and settings, tokens,
layers over the shared cells, appendices).  :func:`diff_files` returns a
:class:`~slotfile.diff.report.DiffReport`; ``to_dict()`` is schema ``slotfile.diff/1``."""

from slotfile.diff.engine import diff_files
from slotfile.diff.report import SCHEMA, DiffReport, Status, Verdict

__all__ = ["SCHEMA", "DiffReport", "Status", "Verdict", "diff_files"]
