# Test-only: installs the named fakes (tests/helpers/sglang_fakes.py) in every process of a CPU
# SGLang server started by the tests. Never used outside tests. The tests put tests/ on the
# server's PYTHONPATH next to this directory (helpers.sglang_world.fakes_pythonpath()).
from helpers import sglang_fakes

sglang_fakes.install()
