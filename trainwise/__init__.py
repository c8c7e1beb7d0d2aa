"""trainwise: train language models and account for what training costs."""

__version__ = "0.1.0"
