"""The magic numbers of slot and session files, and the formats they name, in a module that
imports nothing of slotfile: the grammars, the llama.cpp worker and the loader pool (which
must start cheaply, without numpy or construct: a deep check starts its worker first) read
them here."""

from enum import StrEnum

GGSQ_MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC, include/llama.h ('ggsq')
GGSN_MAGIC = 0x6767736E  # LLAMA_SESSION_MAGIC ('ggsn')
IO_MAGIC = 0xAF143CD8  # llama_context::state_seq_get_data prefix
SCKP_MAGIC = b"SCKP"  # 0x504b4353 little-endian
SDFT_MAGIC = b"SDFT"  # 0x54464453 little-endian
DSV4_MAGIC = 0x34565344


class FileFormat(StrEnum):
    GGSQ = "GGSQ"  # slot file (llama_state_seq_save_file)
    GGSN = "GGSN"  # session file (llama_state_save_file)
    UNKNOWN = "unknown"


class MemoryKind(StrEnum):
    """The kind of a body's memory block (slotfile.format.layout reads which a body holds)."""

    KV = "KV"  # one llama_kv_cache::state_write block
    REC = "REC"  # one llama_memory_recurrent::state_write block
