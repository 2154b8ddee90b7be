"""Layer 3, costs: the target's measured cost profile on a device (`profile`), read by DSpark's
load-aware scheduler (policies) and by the concurrency simulator (analysis)."""
