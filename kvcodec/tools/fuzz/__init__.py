"""Structure-aware fuzzing of containers (issue 14): re-seal mutated files with every checksum recomputed
(:mod:`.container`), mutate every structure and codec section (:mod:`.mutate`), and decode them through the three
read paths in a child process with time and memory limits (:mod:`.runner`, :mod:`.worker`), from real seeds
(:mod:`.seeds`).  ``tests/test_hostile.py`` runs it briefly; ``bench/fuzz_containers.py`` for as long as asked."""
