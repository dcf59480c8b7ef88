"""llama-cpp-python integrations: the ``DSparkDraftModel`` plug-in for ``Llama(draft_model=...)``
and the ``DSpark`` class with ``Llama``'s completion / chat API."""
