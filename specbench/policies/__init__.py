"""Layer 4, policies: every speculative-decoding policy (`pld`, `fixed_k`, `eagle`, `dspark`),
DSpark's schedulers and STS calibration, and the registry that maps `policies/*.toml` specs to
policy objects. Policies implement `specbench.engine.policy.Policy`."""
