"""Hugging Face interchange: Llama-family folders (config.json, safetensors, tokenizer) in and out."""

from plait.hf.config import is_hf_folder, model_args, read_config
from plait.hf.weights import HFWeights, check

__all__ = ["HFWeights", "check", "is_hf_folder", "model_args", "read_config"]
