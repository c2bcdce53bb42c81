"""The ``slotfile`` command line: one module per command, ``app`` wires them to typer."""
