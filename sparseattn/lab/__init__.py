"""The lab: what the project runs *on* the library, not the library itself.

The command line (``sparseattn``, :mod:`.cli`), the tour (:mod:`.tour`), the papers'
experiments (:mod:`.experiments`, registered once in :mod:`.experiments.registry`), the
benchmarks (:mod:`.bench`), the small models they train (:mod:`.models`, the byte LM in
:mod:`.experiments.lm`), corpora, result files, fidelity measures and progress output.
Nothing below imports it (``lint-imports``, ``[tool.importlinter]`` in pyproject.toml); its
modules may change between versions without notice. Needs the ``[cli]`` extras where stated
(``sparseattn._extras``).
"""
