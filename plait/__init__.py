"""plait: PyTorch-native LLM pre-training with composable parallelism."""

__version__ = "0.1.0"
