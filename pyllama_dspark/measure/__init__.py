"""Measuring and comparing: ``bench`` and its report, ``crosscheck`` against ``Llama``, llama-server
(:mod:`pyllama_dspark.upstream`) and the numpy reference of the draft graph (:mod:`pyllama_dspark.reference`)."""
