"""Package mapping only (metadata lives in pyproject.toml).

The design card keeps `hooks/` and `cli/` at the top level of the repository; they install as
`hstrace.hooks` and `hstrace.cli`, so nothing named plain `cli` or `hooks` lands in site-packages.
"""

from setuptools import Extension, find_packages, setup

MAPPED = {"hstrace.cli": "cli", "hstrace.hooks": "hooks"}

packages = find_packages(include=["hstrace", "hstrace.*"])
package_dir = {"hstrace": "hstrace"}
for name, folder in MAPPED.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(where=folder)]

# The producer's one-call step (hstrace/trace/write/_native.c): optional, so an install without
# a C compiler or Python headers still succeeds and hstrace takes the pure-Python route.
native = Extension(
    "hstrace.trace.write._native",
    ["hstrace/trace/write/_native.c"],
    optional=True,
)

# The byte-plane codec for 2-byte columns (hstrace/trace/codecs/_planes.c: the writer encodes,
# the reader's fast path decodes): optional too; without it those chunks go through c-blosc's
# own encoder and decoder, and read back the same.
planes = Extension(
    "hstrace.trace.codecs._planes",
    ["hstrace/trace/codecs/_planes.c"],
    libraries=["dl", "pthread"],
    optional=True,
)

# The vLLM tap thread's per-row math (hstrace/engines/_tapmath.c: draft top-k, verify columns):
# optional too; without it the same columns come from torch (hstrace/engines/tapmath.py).
tapmath = Extension(
    "hstrace.engines._tapmath",
    ["hstrace/engines/_tapmath.c"],
    depends=["hstrace/engines/_tapmath_rows.h"],
    libraries=["m"],
    extra_compile_args=["-Wno-psabi"],  # its 8-lane vectors never cross a call
    optional=True,
)

setup(packages=packages, package_dir=package_dir, ext_modules=[native, planes, tapmath])
