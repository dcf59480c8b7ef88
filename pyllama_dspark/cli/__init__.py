"""The ``pyllama-dspark`` command: ``main`` (the click group) and one module per command family."""
