"""GraphPipe: flatbuffers tensor inference over HTTP (Oracle's spec), for ONNX models and the LM.

codec.py (sans-IO messages) + tensor_codec.py (zero-copy tensors) + core.py (validation,
defaults, batching per model) + server.py (aiohttp transport) + client.py; see docs/graphpipe.md.
"""
