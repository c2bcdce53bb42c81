"""The magic numbers of slot and session files, in a module with no imports: the grammars and
the llama.cpp worker (which must start cheaply, without numpy or construct) read them here."""

GGSQ_MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC, include/llama.h ('ggsq')
GGSN_MAGIC = 0x6767736E  # LLAMA_SESSION_MAGIC ('ggsn')
IO_MAGIC = 0xAF143CD8  # llama_context::state_seq_get_data prefix
SCKP_MAGIC = b"SCKP"  # 0x504b4353 little-endian
SDFT_MAGIC = b"SDFT"  # 0x54464453 little-endian
DSV4_MAGIC = 0x34565344
