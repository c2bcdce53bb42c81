"""The llama.cpp side: finding the library, the settings a body needs, the worker pool, one-shot
requests (prefill, re-save) and the worker program, the only process that imports llama.cpp.
"""
