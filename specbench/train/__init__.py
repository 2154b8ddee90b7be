"""Layer 7, drafter training for a target: data (`data`), shared loop pieces (`common`), trainers
(`draft_lm` for fixed-K, `dspark` for DSpark/DFlash, `eagle` for EAGLE-3-style heads). Beside
analysis (neither imports the other); the `python -m specbench train` command is
`specbench.cli.train`."""
