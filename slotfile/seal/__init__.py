"""Sealing a slot store and identifying models: a checksum manifest (schema
``slotfile.manifest/1``) that catches any changed byte at disk speed, a GGUF fingerprint that
names a model exactly without reading all of it, and a ranking of candidate models for a slot
file proven by recomputing its first K and V rows."""
