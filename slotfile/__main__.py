"""``python -m slotfile``: the command line."""

from slotfile.cli.app import main

main()
