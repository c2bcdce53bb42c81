"""The exit-code contract, modelled on fsck (documented in the README)."""

OK = 0  # every file read (or passed) without errors; warnings allowed
USAGE = 2  # bad command line (typer's own code)
PROBLEMS = 4  # at least one file has errors (damaged, unreadable layout, failed verdict)
OPERATIONAL = 8  # could not do the job: path unreadable, model missing, worker failed to start
