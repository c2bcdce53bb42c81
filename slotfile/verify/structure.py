"""Level 1, structure: the reader's problems (no model needed), and with ``--scan`` every
K/V/R/S value checked finite."""

from __future__ import annotations

from slotfile.format.records import SlotFile
from slotfile.problems import CheckLevel, ProblemCode
from slotfile.verify.records import Level


def level_structure(sf: SlotFile) -> Level:
    """The reader's problems, less the model check's (the model level reports those)."""
    lv = Level(CheckLevel.STRUCTURE)
    lv.problems.extend(sf.file_problems)
    lv.details = {
        "format": sf.format,
        "version": sf.version,
        "layout": sf.body.layout.describe() if sf.body and sf.body.layout else None,
        "checkpoints": len(sf.checkpoints),
        "draft": sf.draft is not None,
    }
    return lv.finish()


def scan_into(lv: Level, sf: SlotFile, jobs: int) -> None:
    """The full data scan (slotfile.format.scan) as part of the structure level."""
    from slotfile.format.scan import scan

    found, scanned, unchecked = scan(sf, jobs=jobs)
    for f in found:
        lv.error(ProblemCode.NON_FINITE, f.section, f.offset, f.message())
    lv.details["scanned_bytes"] = scanned
    if unchecked:
        lv.warn(ProblemCode.UNSCANNED_TYPE, "body", None, f"values of type {', '.join(unchecked)} cannot be checked")
    lv.finish()
