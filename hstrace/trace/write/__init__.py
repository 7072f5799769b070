"""The trace store's fast writer: everything that produces a trace, behind `TraceWriter`.

    writer.py          TraceWriter: validates each step against the first, plans, hands to a sink
    sink.py            the Sink interface; RecorderSink (in the caller's thread), MemorySink
    process_sink.py    ProcessSink: a writer process behind a shared-memory ring (the default)
    ring.py            that ring (segments, descriptor queue); protocol.py: its typed messages
    writer_process.py  the writer process (`python -m hstrace.trace.write.writer_process`)
    recorder.py        RankRecorder: one rank's arrays and commit record
    rowlog.py          rows to chunks and shards: encoding threads, O_DIRECT shard files
    columns.py         one column check the writer, recorder and sinks share
    root.py            create_trace: the trace's root group and run metadata
    _native.c          the producer's optional one-call step (setup.py builds it)

It builds on the format layer (`hstrace.trace`: schema, live-shard layout) and the codecs
(`hstrace.trace.codecs`); neither imports anything from here. Environment flags
(HSTRACE_NATIVE, HSTRACE_PLANES, HSTRACE_DIRECT_IO, HSTRACE_MMAP_THRESHOLD) are read when a
writer is built, and the C extensions are bound on first use, never at import.
"""
