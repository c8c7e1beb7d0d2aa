from trainwise.model.transformer import KVCache, Transformer

__all__ = ["Transformer", "KVCache"]
