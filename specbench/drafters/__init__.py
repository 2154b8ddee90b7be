"""Layer 2, drafters: drafter checkpoints (`checkpoints`) and the drafter networks that policies
draft with (`dspark`: DSpark / DFlash, `eagle`: the EAGLE-3-style head). Built on the engine's
model pieces; knows nothing of policies, benchmarks or reports."""
