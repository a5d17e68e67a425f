"""Tooling around the runtime, for the command line, benchmarks, studies and tests: evaluation, plots, distortion
metrics, importance profiles, exporting a model as a HuggingFace folder, fuzzing, the reference ANS coder and the
golden-file generator.  It imports the runtime, never the other way: only the command line (:mod:`kvcodec.cli`)
imports it, inside the command that needs it (tests/test_structure.py checks it).  What serving needs (loading the
served model, fitting a kvtc calibration) is runtime: :mod:`kvcodec.models`, :mod:`kvcodec.codecs.kvtc.fit`."""
