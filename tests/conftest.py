import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests import the tiny-model helpers directly


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """The embedded default target (SmolLM2-135M-Instruct, fp32 CPU); the first run converts the
    GGUF into the cache (~25 s), later runs load it in about a second."""
    from specbench.engine.loading import load_model

    return load_model("smollm2-135m")
