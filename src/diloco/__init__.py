"""diloco: train one PyTorch model across independent compute islands joined by slow links."""

__version__ = "0.1.0"
