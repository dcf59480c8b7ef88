"""The speculative algorithm: accept rules (``verify``), llama.cpp-compatible sampling
(``sampling``, ``draft_sampling``), verification scheduling (``schedule``, ``policy``,
``calibration``, ``costprofile``) and the proposers behind one interface (``drafter``, ``oracle``)."""
