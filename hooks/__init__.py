"""What hstrace injects into a serving engine (installed as `hstrace.hooks`).

Nothing here may import the engine at module import time: the bootstrap decides, from the
environment, whether to activate at all.
"""
