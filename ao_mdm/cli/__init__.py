"""The `ao-mdm` command: the registry, parsing and the one error wrapper (`main.py`), flags
and checks several commands share (`flags.py`, `checks.py`), and one module per command
(`commands/`)."""
