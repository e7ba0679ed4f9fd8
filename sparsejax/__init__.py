"""sparsejax: JAX-native training and inference for large sparse (recommendation) models."""

from . import ops as ops

__version__ = "0.1.0"
