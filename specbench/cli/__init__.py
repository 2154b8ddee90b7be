"""Layer 8, the command line: `python -m specbench ...` (`main`) and its `train` command (`train`).
The only layer that may import every other one."""
