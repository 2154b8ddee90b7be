"""Drafter training for a target: data (`data`), shared loop pieces (`common`), trainers
(`draft_lm` for fixed-K, `dspark` for DSpark/DFlash, `eagle` for EAGLE-3-style heads), and the
`python -m specbench train` command (`cli`)."""
