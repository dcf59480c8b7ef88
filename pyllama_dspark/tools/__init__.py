"""Measuring and comparing: ``bench`` and its report, ``crosscheck`` against ``Llama`` and
llama-server, the llama-server build-and-run harness and the numpy reference of the draft graph."""
