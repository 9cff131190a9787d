"""Building blocks every model family assembles (model/families/): norms, rotary embeddings,
attention, MLPs and the decoder stack. A family file picks and configures them; it writes no
forward pass of its own."""
