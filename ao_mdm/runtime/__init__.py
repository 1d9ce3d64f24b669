"""This process, below everything else and free of JAX: which process of a launch it is and
whether another lives (`hosts.py`), Ctrl-C and SIGTERM (`interrupts.py`), stderr kept quiet
(`quiet.py`), freed heap handed back (`memory.py`)."""
