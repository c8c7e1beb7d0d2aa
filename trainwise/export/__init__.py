"""Export trained runs to other ecosystems (Hugging Face `transformers`) and import from them."""

from trainwise.export.hf import choose_family, export_hf, load_hf_dir, save_hf

__all__ = ["choose_family", "export_hf", "load_hf_dir", "save_hf"]
