# Test-only (tests/test_vllm_live.py, case f): on the server's PYTHONPATH, behind hstrace's own
# generated sitecustomize (which chains to this one). With HSTRACE_TEST_FAIL_TAP=verify, the
# verify tap's row builder raises inside the real vLLM worker, so the test can check that the
# tap is disabled and recorded while vLLM keeps serving. Nothing else is changed.
import os as _os

if _os.environ.get("HSTRACE_TEST_FAIL_TAP") == "verify" and _os.environ.get("HSTRACE_RECORD"):
    try:
        import hstrace.engines.vllm.taps as _taps
    except ImportError:
        _taps = None
    if _taps is not None:

        def _raising_verify_rows(*args, **kwargs):
            raise RuntimeError("injected by tests/vllm_fault_site (a tap that raises)")

        _taps.verify_rows = _raising_verify_rows
