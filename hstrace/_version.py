"""hstrace's version, in a module of its own: the trace writer stamps it into every trace
(`hstrace.trace.write.root`) without importing the `hstrace` package's public surface."""

__version__ = "0.1.0"
