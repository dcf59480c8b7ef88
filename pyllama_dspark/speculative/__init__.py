"""The speculative algorithm: accept rules (``verify``), llama.cpp-compatible sampling
(``sampling_params``, ``chain``, ``dist``, ``shim``, ``sampling``, ``draft_sampling``), verification scheduling (``schedule``, ``policy``,
``calibration``, ``costprofile``) and the proposers behind one interface (``drafter``, ``oracle``)."""
