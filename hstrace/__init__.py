"""hstrace: find where EAGLE-3 serving and training part ways.

The core (trace store, reference drafter, training readers, replay, diagnosis) imports without
SGLang; the SGLang hooks are the `hstrace[sglang]` extra.
"""

__version__ = "0.1.0"
