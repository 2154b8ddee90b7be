"""specbench: benchmark speculative-decoding policies, losslessly, with error bars."""

__version__ = "0.1.0"
