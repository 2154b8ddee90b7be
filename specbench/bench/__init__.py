"""Layer 5, bench: what a benchmark sends (`workloads`), what decodes it (policy engines and peer
`baselines`), the sweep `runner` with its append-only records, the Ray executor and the run
environment written into every record (`envinfo`)."""
