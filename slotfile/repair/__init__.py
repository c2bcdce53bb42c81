"""Repairs: truncate-recover, strip-draft and re-save, planned as byte ranges of the input.

Every operation looks at the parsed input (:func:`slotfile.format.reader.open_slot_file`), decides
what to keep, drop, rewrite or rebuild, and returns a :class:`~.common.Planned`: a
:class:`slotfile.safewrite.Plan` (byte ranges of the input or of files a llama.cpp worker
wrote, plus framing built by the grammar) and a :class:`Report` saying exactly what happens
to every section.  :func:`run` then writes the plan through :func:`slotfile.safewrite.commit`,
with a structural re-read and (given a model) a real test-load of the temp file as its
check, and reports the :class:`Outcome`; the CLI maps outcomes to exit codes.

Nothing here reads a whole section into memory except small headers; the transposition of V
for a flash-attention flip streams layer by layer (:class:`~.plan.Transposed` pieces).

Modules: ``report`` (outcome, report), ``common`` (options, retry state, shared input
helpers), ``tail`` (the appendix part: what follows the body), ``kept`` / ``rebuilt`` (appendix plans),
``settings`` (the settings a file was saved with), ``plan`` (transposed pieces, commit),
``truncate`` / ``strip_draft`` / ``resave`` (one per command), ``check`` (the output's
check), ``runner`` (attempts and retries).
"""

from slotfile.repair.common import Operational, Planned, Refused, RepairOptions, Retry
from slotfile.repair.report import SCHEMA, Outcome, Report
from slotfile.repair.resave import resave
from slotfile.repair.runner import OPERATIONS, run
from slotfile.repair.settings import probe_body
from slotfile.repair.strip_draft import strip_draft
from slotfile.repair.tail import (
    BlobRef,
    SckpEntry,
    SckpWalk,
    SdftFound,
    Tail,
    analyse_tail,
    parse_sdft_at,
    scan_sckp,
    scan_sdft,
    walk_sckp,
)
from slotfile.repair.truncate import truncate_recover

__all__ = [
    "OPERATIONS",
    "SCHEMA",
    "BlobRef",
    "Operational",
    "Outcome",
    "Planned",
    "Refused",
    "RepairOptions",
    "Report",
    "Retry",
    "SckpEntry",
    "SckpWalk",
    "SdftFound",
    "Tail",
    "analyse_tail",
    "parse_sdft_at",
    "probe_body",
    "resave",
    "run",
    "scan_sckp",
    "scan_sdft",
    "strip_draft",
    "truncate_recover",
    "walk_sckp",
]
