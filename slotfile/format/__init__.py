"""Bytes and records: the grammars of every section, layout detection, the appendix walker, the
parsed records, the reader, the writer, synthetic files and the value scan.

Nothing here imports :mod:`slotfile.llama` (the llama.cpp side) or :mod:`slotfile.cli`.
"""
