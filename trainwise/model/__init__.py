from trainwise.model.attention import KVCache
from trainwise.model.transformer import Transformer

__all__ = ["Transformer", "KVCache"]
