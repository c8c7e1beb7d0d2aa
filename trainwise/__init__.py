"""trainwise: train language models and account for what training costs."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import trainwise` stays fast and torch-free until needed
    if name in ("train", "load", "plan"):
        from trainwise import api

        return getattr(api, name)
    raise AttributeError(name)
