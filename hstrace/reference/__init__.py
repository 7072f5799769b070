"""Reference forwards, shared by the judge (`hstrace.replay`) and the CPU reference engine
(`hstrace.engines.reference`): batched step-0 forwards of the reference drafter (`step0`) and
the HF target's layer-by-layer forward (`target`). Below both: imports only the drafter,
`hstrace.errors` and torch/transformers.
"""
