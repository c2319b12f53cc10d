"""specserve's own PyTorch runtime: the decoder, its weights, its KV cache, its step (the ``torch`` extra).

Nothing here is imported unless ``--backend torch`` is chosen: importing the server never imports torch.
"""
