"""A ``--slot-save-path`` directory as a whole: walking it, server flags, restore checks, pruning."""
