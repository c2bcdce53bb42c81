"""The ``slotfile`` command line (installed as the package ``slotfile.cli``)."""
