"""hstrace's command line (installed as `hstrace.cli`)."""
