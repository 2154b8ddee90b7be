"""specbench: benchmark speculative-decoding policies, losslessly, with error bars."""

__version__ = "0.1.0"

__all__ = ["load_results"]


def __getattr__(name):
    # Lazy: `import specbench` stays light (no pandas / scipy until results are read).
    if name == "load_results":
        from specbench.analysis.stats import load_results

        return load_results
    raise AttributeError(f"module 'specbench' has no attribute {name!r}")
