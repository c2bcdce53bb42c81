"""The model bridge: GGUF metadata, what the model says a state must hold, and the comparison of a
parsed file against it.
"""
