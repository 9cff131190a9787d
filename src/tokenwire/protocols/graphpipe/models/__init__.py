"""Tensor models served over GraphPipe: ONNX graphs (onnxruntime) and the engine's LM."""
