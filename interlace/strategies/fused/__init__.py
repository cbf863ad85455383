"""COMET's fused strategy: inference (``inference``) and training (``train``) calls."""
