"""Built-in policies. `specbench.registry` maps names (and policies/*.toml specs) to them."""
