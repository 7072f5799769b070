# Test-only: installs the named fakes (tests/sglang_fakes.py) in every process of a CPU SGLang
# server started by the tests. Never used outside tests.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sglang_fakes  # noqa: E402

sglang_fakes.install()
