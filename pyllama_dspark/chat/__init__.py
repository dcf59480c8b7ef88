"""Chat formats, apart from the speculative algorithm: chat prompts as llama-cpp-python and
llama-server render them, the tool-call formats of chat templates, their grammars and reply parsers.
They use the grammar engine (:mod:`pyllama_dspark.llama.grammar`) and nothing of the drafting loop."""
