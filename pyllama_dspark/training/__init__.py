"""Training a DSpark drafter for a llama.cpp target (``pyllama-dspark train``).

Stages, each resumable from what it wrote: ``instructions`` (the prompt set), ``datagen`` (target
responses + captured target features + the target's top-k logits), ``model`` / ``trainer`` (the
draft network in PyTorch, exactly the llama.cpp graph), ``export`` (a ``dflash`` GGUF).  The
runtime package never imports this subpackage's torch modules; install the ``[train]`` extra.
"""
